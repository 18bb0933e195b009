import Foundation
#if canImport(Darwin)
import Darwin
#elseif canImport(Glibc)
import Glibc
#endif
#if canImport(os)
import os
#endif

/// The device benchmark behind `cohere-transcribe-swift bench`: one bundle over one dataset folder (the
/// format `cohere_coreml.evaluation.datasets.load_folder` reads), with the figures `cohere-coreml bench --merge-engine`
/// turns into a row of its report (docs/swift.md, "Measuring on a device"; docs/evaluation.md).
///
///     cold load (first transcriber + prewarm: Core ML compiles here unless cached) -> dropped ->
///     warm load (second transcriber, from the cache) -> first clip once (warm-up) -> every clip, timed,
///     memory sampled after each -> placement (MLComputePlan, Core ML only)
///
/// A clip that fails is recorded with its error ("problem") and the others still run.
public enum DeviceBenchmark {
    public static let tool = "cohere-transcribe-swift bench"
    public static let formatVersion = 1

    public struct Options: Sendable {
        public var bundle: URL
        /// The dataset folder, as given (recorded as the dataset's name, like Python's).
        public var dataset: String
        public var computeUnits: ComponentComputeUnits
        /// The `--compute-units` value when one was given for every component.
        public var computeUnitsFlag: ComputeUnits?
        /// One prompt language for every clip; nil: each clip's language from the dataset manifest.
        public var language: String?
        /// Only the first N entries of the manifest.
        public var maxClips: Int?
        public var maxNewTokens: Int?
        /// Run the first clip once before the timed runs (as `cohere-coreml bench`).
        public var warmup: Bool
        /// Called with one line per step (loads, clips).
        public var progress: (@Sendable (String) -> Void)?
        /// The candidate this run measures (a child of the sweep, DeviceSweep.swift): its layout must be one the
        /// bundle holds; recorded in the report. Its compute units are `computeUnits` (the caller sets both).
        public var candidate: DeviceCandidate?
        /// Test hook: what to do at the first prediction (`FaultInjection`, from $COHERE_BENCH_FAULT in a child).
        public var fault: FaultInjection?
        /// Speech windows from the bundle's VAD (`.auto`: when it has vad.mlpackage; docs/vad.md).
        public var vad = VADMode.auto

        public init(bundle: URL, dataset: String, computeUnits: ComponentComputeUnits = .init(),
                    computeUnitsFlag: ComputeUnits? = nil, language: String? = nil, maxClips: Int? = nil,
                    maxNewTokens: Int? = nil, warmup: Bool = true, progress: (@Sendable (String) -> Void)? = nil) {
            self.bundle = bundle
            self.dataset = dataset
            self.computeUnits = computeUnitsFlag.map { .uniform($0) } ?? computeUnits
            self.computeUnitsFlag = computeUnitsFlag
            self.language = language
            self.maxClips = maxClips
            self.maxNewTokens = maxNewTokens
            self.warmup = warmup
            self.progress = progress
        }
    }

    /// Runs the benchmark. Throws when it cannot run at all (dataset, bundle, runtime); per-clip failures
    /// are in the report (`Report.failedClips`).
    public static func run(_ options: Options, runtime: ModelRuntime) async throws -> Report {
        let dataset = try BenchDataset.load(options.dataset)
        let bundle = try BundleRecord.read(options.bundle)
        let manifest = try BundleManifest.load(bundle: options.bundle)
        if let candidate = options.candidate {
            let layouts = try BundleLayout.layouts(bundle: options.bundle)
            guard layouts.contains(candidate.layout) else {
                throw BenchmarkError("candidate \(candidate.id): the bundle \(options.bundle.path) holds no layout "
                    + "\(candidate.layout.id) (it holds: \(layouts.map(\.id).joined(separator: "; ")))")
            }
        }
        // the transcribers' runtime: the fault injector around it when asked (placement and cache use `runtime`)
        let models: ModelRuntime = options.fault.map { FaultInjectingRuntime(base: runtime, fault: $0) } ?? runtime
        if let language = options.language { _ = try manifest.prompt(language: language) }  // unknown: fail now
        if let n = options.maxClips, n < 1 { throw BenchmarkError("--max-clips must be >= 1, got \(n)") }
        _ = try options.vad.resolve(bundleHasVAD: manifest.vad != nil && manifest.files.vad != nil, bundle: options.bundle)
        let eos = Set(bundle.eosTokenIds)
        let say = options.progress ?? { _ in }
        var memory = MemoryRecord()
        memory.beforeLoadMB = memory.sample()
        let cacheBefore = compiledCacheState(runtime: runtime, bundle: options.bundle, manifest: manifest)

        say("cold load: \(options.bundle.path) (\(runtime.name))")
        var clock = Stopwatch()
        var cold: CohereTranscriber? = try await CohereTranscriber(bundle: options.bundle, runtime: models,
                                                                   computeUnits: options.computeUnits, deviceChoice: .none)
        var load = LoadRecord()
        load.coldInit = clock.lap()
        try await cold!.prewarm()
        load.coldPrewarm = clock.lap()
        load.cold = load.coldInit + load.coldPrewarm
        load.coldTranscriberLoad = await cold!.loadSeconds
        memory.afterColdLoadMB = memory.sample()
        cold = nil  // freed before the second load: one model set resident at a time
        say("warm load")
        let transcriber = try await CohereTranscriber(bundle: options.bundle, runtime: models,
                                                      computeUnits: options.computeUnits, deviceChoice: .none)
        load.warmInit = clock.lap()
        try await transcriber.prewarm()
        load.warmPrewarm = clock.lap()
        load.warm = load.warmInit + load.warmPrewarm
        load.warmTranscriberLoad = await transcriber.loadSeconds
        load.compiledCacheBefore = cacheBefore
        load.note = runtime.name == "coreml"
            ? "cold: first CohereTranscriber + prewarm(), including compiling every package absent from the compiled-model "
                + "cache (compiled_cache_before); warm: a second transcriber on the same bundle, from that cache"
            : "cold: first CohereTranscriber + prewarm() (the interpreter child parses the packages); warm: a second one"
        memory.afterLoadMB = memory.sample()

        var clips: [ClipRecord] = []
        var firstRun: Double?
        let entries = options.maxClips.map { Array(dataset.entries.prefix($0)) } ?? dataset.entries
        for (n, entry) in entries.enumerated() {
            var clip = ClipRecord(index: entry.index, id: entry.id, file: entry.file, language: entry.language,
                                  promptLanguage: options.language ?? entry.language)
            defer { clips.append(clip) }
            if let problem = entry.problem {
                (clip.status, clip.problem) = ("problem", problem)
                say("[\(n + 1)/\(entries.count)] \(entry.id): \(problem)")
                continue
            }
            let url = entry.url
            do {
                if options.warmup && firstRun == nil {
                    clock.lap()
                    let r = try await transcriber.transcribe(contentsOf: url, language: clip.promptLanguage,
                                                             maxNewTokens: options.maxNewTokens, vad: options.vad)
                    let t = clock.lap()
                    if !r.silent { firstRun = t }
                }
                clock.lap()
                let r = try await transcriber.transcribe(contentsOf: url, language: clip.promptLanguage,
                                                         maxNewTokens: options.maxNewTokens, vad: options.vad)
                clip.processingSeconds = clock.lap()
                clip.fill(r, eos: eos)
                clip.memoryMB = memory.sample()
                say("[\(n + 1)/\(entries.count)] \(entry.id): \(String(format: "%.2f", clip.processingSeconds ?? 0)) s, "
                    + "\(r.silent ? "(silent)" : r.text)")
            } catch {
                (clip.status, clip.problem) = ("problem", "\(error)")
                clip.memoryMB = memory.sample()
                say("[\(n + 1)/\(entries.count)] \(entry.id): error: \(error)")
            }
        }
        memory.finish(runtime: runtime)

        say("placement")
        let (placement, reason) = await measurePlacement(runtime: runtime, bundle: options.bundle, manifest: manifest,
                                                         units: options.computeUnits)
        var units = UnitsRecord(flag: options.computeUnitsFlag?.rawValue, frontEnd: options.computeUnits.frontEnd.rawValue,
                                encoder: options.computeUnits.encoder.rawValue, decoder: options.computeUnits.decoder.rawValue)
        if runtime.name != "coreml" { units.note = "the interpreter ignores compute units" }
        let report = Report(
            createdUTC: ISO8601DateFormatter().string(from: Date()), runtime: runtime.name, computeUnits: units,
            machine: MachineRecord.current(), dataset: dataset.record(benched: entries.count), bundle: bundle,
            options: OptionsRecord(maxClips: options.maxClips, language: options.language,
                                   languageFromManifest: options.language == nil, maxNewTokens: options.maxNewTokens,
                                   warmup: options.warmup, vad: options.vad.rawValue),
            load: load, firstRunSeconds: firstRun, memory: memory, placement: placement, placementReason: reason,
            totals: Totals(clips), clips: clips,
            candidate: options.candidate.map {
                CandidateRecord(id: $0.id, computeUnits: $0.computeUnits.rawValue, layout: $0.layout.values)
            })
        #if canImport(os)
        let (count, failed, coldSeconds, warmSeconds) = (clips.count, report.failedClips, load.cold, load.warm)
        Logger(subsystem: "CohereTranscribe", category: "bench").info(
            "bench: \(count) clips, cold load \(coldSeconds) s, warm load \(warmSeconds) s, \(failed) failed")
        #endif
        return report
    }

    // MARK: - placement

    /// The functions of every package the transcriber uses, with their compute units (from the raw manifest,
    /// so any decoder function it lists is included).
    static func placementTargets(bundle: URL, manifest: BundleManifest, units: ComponentComputeUnits) -> [PlacementTarget] {
        let raw = (try? JSONSerialization.jsonObject(with: Data(contentsOf: bundle.appendingPathComponent(BundleManifest.fileName))))
            as? [String: Any] ?? [:]
        func keys(_ component: String) -> [String] {
            ((raw[component] as? [String: Any])?["functions"] as? [String: Any])?.keys.sorted() ?? []
        }
        var targets: [PlacementTarget] = []
        if let frontend = manifest.files.frontend, !keys("frontend").isEmpty {
            targets.append(PlacementTarget(package: bundle.appendingPathComponent(frontend), functions: keys("frontend"),
                                           units: units.frontEnd))
        }
        targets.append(PlacementTarget(package: bundle.appendingPathComponent(manifest.files.encoder),
                                       functions: manifest.encoderBuckets.map(\.function), units: units.encoder))
        let decoderFunctions = ((raw["decoder"] as? [String: Any])?["functions"] as? [String: Any])?.values
            .compactMap { $0 as? String } ?? []
        targets.append(PlacementTarget(package: bundle.appendingPathComponent(manifest.files.decoder),
                                       functions: decoderFunctions.isEmpty ? ["main"] : Array(Set(decoderFunctions)).sorted(),
                                       units: units.decoder))
        return targets
    }

    static func measurePlacement(runtime: ModelRuntime, bundle: URL, manifest: BundleManifest,
                                 units: ComponentComputeUnits) async -> (PlacementRecord, String?) {
        let targets = placementTargets(bundle: bundle, manifest: manifest, units: units)
        #if os(Linux)
        // The emulated MLComputePlan.load throws before reading anything: nothing is compiled here.
        do {
            var rows: [FunctionPlacement] = []
            for target in targets {
                rows += try await ComputePlanWalker.placement(compiled: target.package, target: target)
            }
            return (.functions(rows), nil)
        } catch {
            return (.unavailable, "\(error)")
        }
        #elseif os(macOS) || os(iOS)
        guard let coreml = runtime as? CoreMLRuntime else {
            return (.unavailable, "the \(runtime.name) runtime does not run Core ML: placement is measured with --runtime coreml")
        }
        guard #available(macOS 14.4, iOS 17.4, *) else {
            return (.unavailable, "MLComputePlan needs macOS 14.4 / iOS 17.4")
        }
        var rows: [FunctionPlacement] = []
        for target in targets {
            do {
                let compiled = try await coreml.compiledModel(for: target.package)  // cached by the loads above
                rows += try await ComputePlanWalker.placement(compiled: compiled, target: target)
            } catch {
                rows += target.functions.map {
                    var row = FunctionPlacement(package: target.package.lastPathComponent, function: $0,
                                                computeUnits: target.units.rawValue)
                    row.error = "MLComputePlan.load failed: \(error.localizedDescription)"
                    return row
                }
            }
        }
        return (.functions(rows), nil)
        #else
        return (.unavailable, "MLComputePlan exists on macOS 14.4 / iOS 17.4 only")
        #endif
    }

    /// Per package, whether `CoreMLRuntime`'s compiled-model cache held it before the cold load (nil for
    /// other runtimes): a cold load with every entry true did not compile.
    static func compiledCacheState(runtime: ModelRuntime, bundle: URL, manifest: BundleManifest) -> [String: Bool]? {
        #if os(macOS) || os(iOS) || os(Linux)
        guard let coreml = runtime as? CoreMLRuntime else { return nil }
        var state: [String: Bool] = [:]
        for file in [manifest.files.frontend, manifest.files.encoder, manifest.files.decoder].compactMap({ $0 }) {
            let package = bundle.appendingPathComponent(file)
            state[file] = (try? coreml.cachedLocation(for: package)).map(CompiledModelCache.isComplete) ?? false
        }
        return state
        #else
        return nil
        #endif
    }
}

/// The benchmark cannot run (dataset, options).
public struct BenchmarkError: Error, CustomStringConvertible, LocalizedError {
    public var message: String
    public init(_ message: String) { self.message = message }
    public var description: String { message }
    public var errorDescription: String? { message }
}
