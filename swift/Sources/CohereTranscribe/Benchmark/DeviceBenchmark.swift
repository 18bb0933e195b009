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
/// turns into a row of its report (docs/swift.md, "Measuring on a device"; docs/benchmarks.md).
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
                                                             maxNewTokens: options.maxNewTokens)
                    let t = clock.lap()
                    if !r.silent { firstRun = t }
                }
                clock.lap()
                let r = try await transcriber.transcribe(contentsOf: url, language: clip.promptLanguage,
                                                         maxNewTokens: options.maxNewTokens)
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
                                   warmup: options.warmup),
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
            state[file] = (try? coreml.cachedLocation(for: package)).map(CoreMLRuntime.isComplete) ?? false
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

// MARK: - dataset

/// A dataset folder read exactly as `cohere_coreml.evaluation.datasets.load_folder` reads it (manifest.jsonl, else
/// manifest.json: a list or {"utterances" | "clips" | "items": [...]}; "file" | "audio" | "path", "text",
/// "language", optional "id"), with the manifest's sha256 over its bytes (as Python's).
public struct BenchDataset: Sendable {
    public struct Entry: Sendable {
        /// Position in the manifest (ids need not be unique).
        public var index: Int
        public var id: String
        public var file: String?
        public var url: URL
        public var text: String
        public var language: String
        /// Why the clip cannot be scored (no file named, file missing, empty reference), as Python says it.
        public var problem: String?
    }

    public var name: String
    public var manifestPath: String
    public var manifestSHA256: String
    public var entries: [Entry]

    public static func load(_ folder: String) throws -> BenchDataset {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: folder, isDirectory: &isDirectory), isDirectory.boolValue else {
            throw BenchmarkError("dataset folder not found: \(folder)")
        }
        let directory = URL(fileURLWithPath: folder)
        guard let name = ["manifest.jsonl", "manifest.json"].first(where: {
            FileManager.default.fileExists(atPath: directory.appendingPathComponent($0).path)
        }) else {
            throw BenchmarkError("no manifest.jsonl or manifest.json in \(folder)")
        }
        let path = (folder as NSString).appendingPathComponent(name)
        let manifestURL = directory.appendingPathComponent(name)
        let data = try Data(contentsOf: manifestURL)
        var list: [Any]
        do {
            if name.hasSuffix(".jsonl") {
                list = try String(decoding: data, as: UTF8.self).split(whereSeparator: \.isNewline)
                    .filter { !$0.trimmingCharacters(in: .whitespaces).isEmpty }
                    .map { try JSONSerialization.jsonObject(with: Data($0.utf8), options: [.fragmentsAllowed]) }
            } else {
                let top = try JSONSerialization.jsonObject(with: data, options: [.fragmentsAllowed])
                if let dict = top as? [String: Any] {
                    guard let l = ["utterances", "clips", "items"].lazy.compactMap({ dict[$0] as? [Any] })
                        .first(where: { !$0.isEmpty }) else {
                        throw BenchmarkError("\(path): expected a list of entries (or an 'utterances' list)")
                    }
                    list = l
                } else if let l = top as? [Any] {
                    list = l
                } else {
                    throw BenchmarkError("\(path): expected a list of entries (or an 'utterances' list)")
                }
            }
        } catch let error as BenchmarkError {
            throw error
        } catch {
            throw BenchmarkError("\(path): not valid JSON (\(error.localizedDescription))")
        }
        func text(_ value: Any?) -> String? {
            switch value {
            case let s as String: return s.isEmpty ? nil : s
            case let n as NSNumber: return n == 0 ? nil : n.stringValue
            default: return nil
            }
        }
        var entries: [Entry] = []
        for (i, item) in list.enumerated() {
            guard let entry = item as? [String: Any] else { throw BenchmarkError("\(path): entry \(i) is not an object") }
            guard let language = text(entry["language"]) else { throw BenchmarkError("\(path): entry \(i) has no language") }
            let file = text(entry["file"]) ?? text(entry["audio"]) ?? text(entry["path"])
            let reference = text(entry["text"]) ?? ""
            let url = file.map { $0.hasPrefix("/") ? URL(fileURLWithPath: $0) : directory.appendingPathComponent($0) }
                ?? directory
            var problem: String?
            if let file {
                if !FileManager.default.fileExists(atPath: url.path) {
                    problem = "audio file not found: \(displayPath(folder, file))"
                } else if reference.trimmingCharacters(in: .whitespacesAndNewlines).isEmpty {
                    problem = "empty reference transcript"
                }
            } else {
                problem = "no audio file named"
            }
            entries.append(Entry(index: i, id: text(entry["id"]) ?? file ?? String(i), file: file, url: url,
                                 text: reference, language: language, problem: problem))
        }
        guard !entries.isEmpty else { throw BenchmarkError("\(path) lists no clips") }
        return BenchDataset(name: folder, manifestPath: path, manifestSHA256: try SHA256.hexDigest(ofFile: manifestURL),
                            entries: entries)
    }

    private static func displayPath(_ folder: String, _ file: String) -> String {
        file.hasPrefix("/") ? file : (folder as NSString).appendingPathComponent(file)
    }

    public var languages: [String] { Array(Set(entries.map(\.language))).sorted() }

    func record(benched: Int) -> DeviceBenchmark.DatasetRecord {
        DeviceBenchmark.DatasetRecord(name: name, manifest: manifestPath, manifestSHA256: manifestSHA256, clips: entries.count,
                      benchedClips: benched, languages: languages)
    }
}

// MARK: - report

extension DeviceBenchmark {

    /// The JSON `cohere-transcribe-swift bench` writes (schema: docs/swift.md, "Measuring on a device").
    public struct Report: Encodable, Sendable {
        public var tool = DeviceBenchmark.tool
        public var formatVersion = DeviceBenchmark.formatVersion
        public var createdUTC: String
        public var runtime: String
        public var computeUnits: UnitsRecord
        public var machine: MachineRecord
        public var dataset: DatasetRecord
        public var bundle: BundleRecord
        public var options: OptionsRecord
        public var load: LoadRecord
        public var firstRunSeconds: Double?
        public var memory: MemoryRecord
        public var placement: PlacementRecord
        public var placementReason: String?
        public var totals: Totals
        public var clips: [ClipRecord]
        /// The sweep's candidate this report measures (nil: a plain `bench` run).
        public var candidate: CandidateRecord?

        public var failedClips: Int { clips.filter { $0.status == "problem" }.count }

        enum CodingKeys: String, CodingKey {
            case tool, formatVersion = "format_version", createdUTC = "created_utc", runtime, computeUnits = "compute_units",
                 machine, dataset, bundle, options, load, firstRunSeconds = "first_run_s", memory, placement,
                 placementReason = "placement_reason", totals, clips, candidate
        }

        public func json() throws -> Data {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
            return try encoder.encode(self)
        }
    }

    public struct CandidateRecord: Encodable, Sendable {
        public var id: String
        public var computeUnits: String
        public var layout: [String: String]

        enum CodingKeys: String, CodingKey { case id, computeUnits = "compute_units", layout }
    }

    public struct UnitsRecord: Encodable, Sendable {
        public var flag: String?
        public var frontEnd: String
        public var encoder: String
        public var decoder: String
        public var note: String?

        enum CodingKeys: String, CodingKey { case flag, frontEnd = "front_end", encoder, decoder, note }
    }

    public struct DatasetRecord: Encodable, Sendable {
        public var name: String
        public var manifest: String
        public var manifestSHA256: String
        public var clips: Int
        public var benchedClips: Int
        public var languages: [String]

        enum CodingKeys: String, CodingKey {
            case name, manifest, manifestSHA256 = "manifest_sha256", clips, benchedClips = "benched_clips", languages
        }
    }

    public struct OptionsRecord: Encodable, Sendable {
        public var maxClips: Int?
        public var language: String?
        public var languageFromManifest: Bool
        public var maxNewTokens: Int?
        public var warmup: Bool
        public var beams = 1
        public var repetitionGuard = false

        enum CodingKeys: String, CodingKey {
            case maxClips = "max_clips", language, languageFromManifest = "language_from_manifest",
                 maxNewTokens = "max_new_tokens", warmup, beams, repetitionGuard = "repetition_guard"
        }
    }

    /// The benched bundle, described as `cohere_coreml.evaluation.bench.bundle_info` describes it (+ what scoring needs).
    public struct BundleRecord: Encodable, Sendable {
        public var dir: String
        public var manifestSHA256: String
        public var modelId: String?
        public var precision: String?
        public var preset: String?
        public var gate: String
        /// Encoder + decoder packages (MB, 2^20 bytes), as Python's `size_mb`.
        public var sizeMB: Double
        public var eosTokenIds: [Int]
        public var prefill: Bool
        public var capacity: Int?

        enum CodingKeys: String, CodingKey {
            case dir, manifestSHA256 = "manifest_sha256", modelId = "model_id", precision, preset, gate, sizeMB = "size_mb",
                 eosTokenIds = "eos_token_ids", prefill, capacity
        }

        static func read(_ bundle: URL) throws -> BundleRecord {
            let manifestURL = bundle.appendingPathComponent(BundleManifest.fileName)
            guard FileManager.default.fileExists(atPath: manifestURL.path) else {
                throw BundleError.missingFile("no manifest.json in \(bundle.path)")
            }
            let raw = try JSONSerialization.jsonObject(with: Data(contentsOf: manifestURL)) as? [String: Any] ?? [:]
            let files = raw["files"] as? [String: Any] ?? [:]
            let decoder = raw["decoder"] as? [String: Any] ?? [:]
            let tokens = raw["tokens"] as? [String: Any] ?? [:]
            var gate = "export"
            let compression = bundle.appendingPathComponent("compression.json")
            if FileManager.default.fileExists(atPath: compression.path) {
                let c = (try? JSONSerialization.jsonObject(with: Data(contentsOf: compression))) as? [String: Any]
                let g = c?["gate"] as? [String: Any] ?? [:]
                gate = (g["skipped"] as? Bool ?? false) ? "skipped" : (g["passed"] as? Bool ?? false) ? "passed" : "unknown"
            }
            let packages = ["encoder", "decoder"].compactMap { files[$0] as? String }.map { bundle.appendingPathComponent($0) }
            let bytes = packages.reduce(0) { $0 + directoryBytes($1) }
            return BundleRecord(dir: bundle.path, manifestSHA256: try SHA256.hexDigest(ofFile: manifestURL),
                                modelId: raw["model_id"] as? String, precision: raw["precision"] as? String,
                                preset: raw["preset"] as? String ?? "f16", gate: gate,
                                sizeMB: (Double(bytes) / 1_048_576 * 1000).rounded() / 1000,
                                eosTokenIds: tokens["eos_token_ids"] as? [Int] ?? [],
                                prefill: (decoder["functions"] as? [String: Any])?["prefill"] is String,
                                capacity: decoder["capacity"] as? Int)
        }

        static func directoryBytes(_ url: URL) -> Int {
            guard let files = FileManager.default.enumerator(at: url, includingPropertiesForKeys: [.fileSizeKey, .isRegularFileKey])
            else { return 0 }
            var total = 0
            for case let file as URL in files {
                let values = try? file.resourceValues(forKeys: [.fileSizeKey, .isRegularFileKey])
                if values?.isRegularFile == true { total += values?.fileSize ?? 0 }
            }
            return total
        }
    }

    /// Cold and warm load, seconds. Each: `CohereTranscriber.init` (decoder, prefill, full-window encoder) +
    /// `prewarm()` (every other encoder bucket and front-end function).
    public struct LoadRecord: Encodable, Sendable {
        public var cold = 0.0
        public var coldInit = 0.0
        public var coldPrewarm = 0.0
        /// `CohereTranscriber.loadSeconds` of the first transcriber (package loads only).
        public var coldTranscriberLoad = 0.0
        public var warm = 0.0
        public var warmInit = 0.0
        public var warmPrewarm = 0.0
        public var warmTranscriberLoad = 0.0
        public var compiledCacheBefore: [String: Bool]?
        public var note = ""

        enum CodingKeys: String, CodingKey {
            case cold = "cold_s", coldInit = "cold_init_s", coldPrewarm = "cold_prewarm_s",
                 coldTranscriberLoad = "cold_transcriber_load_s", warm = "warm_s", warmInit = "warm_init_s",
                 warmPrewarm = "warm_prewarm_s", warmTranscriberLoad = "warm_transcriber_load_s",
                 compiledCacheBefore = "compiled_cache_before", note
        }
    }

    /// Memory of this process, MB (2^20 bytes). Darwin: `phys_footprint` (task_info TASK_VM_INFO), the figure
    /// iOS's memory limit applies to, sampled before/after the loads and after each clip (peak = the largest
    /// sample). Linux: VmHWM of /proc/self/status (the kernel's peak resident size); the interpreter child's
    /// memory is not in it (its own VmHWM is `interpreter_child_peak_mb`).
    public struct MemoryRecord: Encodable, Sendable {
        public var measure: String
        public var beforeLoadMB: Double?
        public var afterColdLoadMB: Double?
        public var afterLoadMB: Double?
        public var peakMB: Double?
        public var interpreterChildPeakMB: Double?
        public var includesInterpreterChild = false
        public var note: String

        enum CodingKeys: String, CodingKey {
            case measure, beforeLoadMB = "before_load_mb", afterColdLoadMB = "after_cold_load_mb",
                 afterLoadMB = "after_load_mb", peakMB = "peak_mb", interpreterChildPeakMB = "interpreter_child_peak_mb",
                 includesInterpreterChild = "includes_interpreter_child", note
        }

        init() {
            #if canImport(Darwin)
            measure = "phys_footprint"
            note = "task_info(TASK_VM_INFO).phys_footprint of this process, sampled after the loads and after each clip; "
                + "peak_mb is the largest sample"
            #else
            measure = "VmHWM"
            note = "VmHWM of /proc/self/status (peak resident set of this process); the interpreter child's memory "
                + "(cohere-coreml serve-runtime) is not in it: see interpreter_child_peak_mb"
            #endif
        }

        /// The measure now (Darwin: footprint; Linux: peak so far), folded into `peakMB`.
        mutating func sample() -> Double? {
            let value = MemoryRecord.currentMB()
            if let value { peakMB = max(peakMB ?? 0, value) }
            return value
        }

        mutating func finish(runtime: ModelRuntime) {
            _ = sample()
            #if os(Linux)
            if let interpreter = runtime as? InterpreterRuntime {
                interpreterChildPeakMB = MemoryRecord.procStatusMB(path: "/proc/\(interpreter.processIdentifier)/status", key: "VmHWM")
            }
            #endif
        }

        static func currentMB() -> Double? {
            #if canImport(Darwin)
            var info = task_vm_info_data_t()
            var count = mach_msg_type_number_t(MemoryLayout<task_vm_info_data_t>.size / MemoryLayout<integer_t>.size)
            let result = withUnsafeMutablePointer(to: &info) {
                $0.withMemoryRebound(to: integer_t.self, capacity: Int(count)) {
                    task_info(mach_task_self_, task_flavor_t(TASK_VM_INFO), $0, &count)
                }
            }
            guard result == KERN_SUCCESS else { return nil }
            return (Double(info.phys_footprint) / 1_048_576 * 10).rounded() / 10
            #else
            return procStatusMB(path: "/proc/self/status", key: "VmHWM")
            #endif
        }

        /// A "Key:   1234 kB" line of a /proc status file, in MB.
        static func procStatusMB(path: String, key: String) -> Double? {
            guard let text = try? String(contentsOfFile: path, encoding: .utf8) else { return nil }
            for line in text.split(separator: "\n") where line.hasPrefix(key + ":") {
                let fields = line.split(whereSeparator: { $0 == " " || $0 == "\t" })
                if fields.count >= 2, let kb = Double(fields[1]) { return (kb / 1024 * 10).rounded() / 10 }
            }
            return nil
        }
    }

    public struct MachineRecord: Encodable, Sendable {
        public var platform: String
        public var os: String
        public var osVersion: String
        /// Hardware model: macOS `hw.model` (e.g. Mac14,2), iOS the machine id (e.g. iPhone15,2), else `uname -m`.
        public var device: String
        public var chip: String?
        public var cpus: Int
        public var memoryGB: Double
        public var simulator = false

        enum CodingKeys: String, CodingKey {
            case platform, os, osVersion = "os_version", device, chip, cpus, memoryGB = "memory_gb", simulator
        }

        static func current() -> MachineRecord {
            var u = utsname()
            _ = uname(&u)
            let machine = withUnsafeBytes(of: &u.machine) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            #if os(macOS)
            let (platform, device, chip) = ("macOS", sysctl("hw.model") ?? machine, sysctl("machdep.cpu.brand_string"))
            #elseif os(iOS)
            let (platform, device, chip) = ("iOS", ProcessInfo.processInfo.environment["SIMULATOR_MODEL_IDENTIFIER"] ?? machine,
                                            sysctl("machdep.cpu.brand_string"))
            #elseif os(Linux)
            let (platform, device, chip): (String, String, String?) = ("Linux", machine, nil)
            #else
            let (platform, device, chip): (String, String, String?) = ("other", machine, nil)
            #endif
            var record = MachineRecord(platform: platform, os: platform,
                                       osVersion: ProcessInfo.processInfo.operatingSystemVersionString, device: device,
                                       chip: chip, cpus: ProcessInfo.processInfo.activeProcessorCount,
                                       memoryGB: (Double(ProcessInfo.processInfo.physicalMemory) / 1_073_741_824 * 10).rounded() / 10)
            #if targetEnvironment(simulator)
            record.simulator = true
            #endif
            return record
        }

        static func sysctl(_ name: String) -> String? {
            #if canImport(Darwin)
            var size = 0
            guard sysctlbyname(name, nil, &size, nil, 0) == 0, size > 0 else { return nil }
            var buffer = [CChar](repeating: 0, count: size)
            guard sysctlbyname(name, &buffer, &size, nil, 0) == 0 else { return nil }
            return String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
            #else
            return nil
            #endif
        }
    }

    /// `"unavailable"` (with `Report.placementReason`) or `{"functions": [...]}`.
    public enum PlacementRecord: Encodable, Sendable {
        case unavailable
        case functions([FunctionPlacement])

        enum CodingKeys: String, CodingKey { case functions }

        public func encode(to encoder: Encoder) throws {
            switch self {
            case .unavailable:
                var c = encoder.singleValueContainer()
                try c.encode("unavailable")
            case .functions(let rows):
                var c = encoder.container(keyedBy: CodingKeys.self)
                try c.encode(rows, forKey: .functions)
            }
        }

        public var isUnavailable: Bool { if case .unavailable = self { return true } else { return false } }
    }

    /// One window as the bench records it: token ids (eos included), stop reason, per-stage warm timings.
    public struct WindowRecord: Encodable, Sendable {
        public var index: Int
        public var startSeconds: Double
        public var endSeconds: Double
        public var tokenIds: [Int]
        public var text: String
        public var truncated: Bool
        public var stopReason: String
        public var encoderFunction: String
        public var featuresSeconds: Double
        public var encoderSeconds: Double
        public var promptSeconds: Double
        public var decodeSeconds: Double
        public var decoderCalls: Int
        public var msPerDecoderCall: Double

        enum CodingKeys: String, CodingKey {
            case index, startSeconds = "start_s", endSeconds = "end_s", tokenIds = "token_ids", text, truncated,
                 stopReason = "stop_reason", encoderFunction = "encoder_function", featuresSeconds = "features_s",
                 encoderSeconds = "encoder_s", promptSeconds = "prompt_s", decodeSeconds = "decode_s",
                 decoderCalls = "decoder_calls", msPerDecoderCall = "ms_per_decoder_call"
        }
    }

    /// One dataset entry's run. status: "ok" | "silent" (empty transcript, no model call) | "problem" (see `problem`).
    public struct ClipRecord: Encodable, Sendable {
        public var index: Int
        public var id: String
        public var file: String?
        public var language: String
        public var promptLanguage: String
        public var status = "ok"
        public var problem: String?
        public var audioSeconds: Double?
        public var processingSeconds: Double?
        public var hypothesis: String?
        /// Per window (eos included when reached).
        public var tokenIds: [[Int]]?
        public var stopReasons: [String]?
        /// Tokens emitted, eos excluded.
        public var tokens: Int?
        public var windows: [WindowRecord]?
        public var memoryMB: Double?

        enum CodingKeys: String, CodingKey {
            case index, id, file, language, promptLanguage = "prompt_language", status, problem, audioSeconds = "audio_s",
                 processingSeconds = "processing_s", hypothesis, tokenIds = "token_ids", stopReasons = "stop_reasons",
                 tokens, windows, memoryMB = "memory_mb"
        }

        mutating func fill(_ r: TranscriptionResult, eos: Set<Int>) {
            status = r.silent ? "silent" : "ok"
            audioSeconds = r.seconds
            hypothesis = r.text
            windows = r.windows.map { w in
                let t = w.timings
                return WindowRecord(index: w.index, startSeconds: w.startSeconds, endSeconds: w.startSeconds + w.durationSeconds,
                                    tokenIds: w.tokenIds, text: w.text, truncated: w.truncated,
                                    stopReason: stopReasonName(w.stopReason), encoderFunction: t.encoderFunction,
                                    featuresSeconds: t.featuresSeconds, encoderSeconds: t.encoderSeconds,
                                    promptSeconds: t.promptSeconds, decodeSeconds: t.decodeSeconds,
                                    decoderCalls: t.decoderCalls, msPerDecoderCall: t.msPerDecoderCall)
            }
            tokenIds = windows?.map(\.tokenIds)
            stopReasons = windows?.map(\.stopReason)
            tokens = windows?.reduce(0) { $0 + $1.tokenIds.filter { !eos.contains($0) }.count }
        }
    }

    /// Sums over the clips scored (ok and silent), as `cohere-coreml bench` sums them.
    public struct Totals: Encodable, Sendable {
        public var clips: Int
        public var clipsOK: Int
        public var clipsSilent: Int
        public var clipsFailed: Int
        public var windows: Int
        public var audioSeconds: Double
        public var processingSeconds: Double
        /// Audio seconds / transcription seconds (warm runs).
        public var rtfx: Double?
        public var stages: [String: Double]
        /// Emitted tokens, eos excluded.
        public var decodeTokens: Int
        /// decodeTokens / (prompt + decode seconds).
        public var tokensPerSecond: Double?
        public var decoderCalls: Int
        public var msPerDecoderCall: Double?

        enum CodingKeys: String, CodingKey {
            case clips, clipsOK = "clips_ok", clipsSilent = "clips_silent", clipsFailed = "clips_failed", windows,
                 audioSeconds = "audio_s", processingSeconds = "processing_s", rtfx, stages = "stages_s",
                 decodeTokens = "decode_tokens", tokensPerSecond = "tokens_per_s", decoderCalls = "decoder_calls",
                 msPerDecoderCall = "ms_per_decoder_call"
        }

        init(_ clips: [ClipRecord]) {
            let scored = clips.filter { $0.status != "problem" }
            let windows = scored.flatMap { $0.windows ?? [] }
            self.clips = clips.count
            clipsOK = clips.filter { $0.status == "ok" }.count
            clipsSilent = clips.filter { $0.status == "silent" }.count
            clipsFailed = clips.count - scored.count
            self.windows = windows.count
            audioSeconds = scored.reduce(0) { $0 + ($1.audioSeconds ?? 0) }
            processingSeconds = scored.reduce(0) { $0 + ($1.processingSeconds ?? 0) }
            rtfx = processingSeconds > 0 ? audioSeconds / processingSeconds : nil
            stages = ["features_s": windows.reduce(0) { $0 + $1.featuresSeconds },
                      "encoder_s": windows.reduce(0) { $0 + $1.encoderSeconds },
                      "prompt_s": windows.reduce(0) { $0 + $1.promptSeconds },
                      "decode_s": windows.reduce(0) { $0 + $1.decodeSeconds }]
            decodeTokens = scored.reduce(0) { $0 + ($1.tokens ?? 0) }
            let generation = stages["prompt_s"]! + stages["decode_s"]!
            tokensPerSecond = generation > 0 ? Double(decodeTokens) / generation : nil
            decoderCalls = windows.reduce(0) { $0 + $1.decoderCalls }
            msPerDecoderCall = decoderCalls > 0 ? 1000 * generation / Double(decoderCalls) : nil
        }
    }
}

/// The stop reason as its wire name, whether `WindowResult.stopReason` is a String or a String-valued enum.
func stopReasonName(_ reason: String) -> String { reason }
func stopReasonName<T: RawRepresentable>(_ reason: T) -> String where T.RawValue == String { reason.rawValue }

/// Monotonic lap timer.
struct Stopwatch {
    private var last = ContinuousClock.now

    /// Seconds since the previous lap (or creation).
    @discardableResult
    mutating func lap() -> Double {
        let now = ContinuousClock.now
        let d = last.duration(to: now)
        last = now
        return Double(d.components.seconds) + Double(d.components.attoseconds) * 1e-18
    }
}

// MARK: - fault injection (tests of the sweep)

/// What a bench child does at its first prediction when $COHERE_BENCH_FAULT names its candidate: stand in for a
/// Neural Engine compile failure that passes load and kills the process at the first prediction (coremltools issue
/// 2758). `COHERE_BENCH_FAULT=<compute units | candidate id | *>:<sigkill | abort | exit | hang>[;...]`, e.g.
/// `cpu_and_ne:sigkill;cpu_and_gpu:exit` (exit: status 3). A test hook: nothing sets it but a test.
public struct FaultInjection: Sendable, Equatable {
    public enum Action: String, Sendable { case sigkill, abort, exit, hang }
    public var action: Action

    public static let environmentVariable = "COHERE_BENCH_FAULT"

    /// The fault $COHERE_BENCH_FAULT names for `candidate`, if any; a malformed value is an error naming it.
    public static func from(environment: [String: String], candidate: DeviceCandidate) throws -> FaultInjection? {
        guard let value = environment[environmentVariable], !value.isEmpty else { return nil }
        for entry in value.split(separator: ";") {  // the first entry naming the candidate
            guard let colon = entry.lastIndex(of: ":"),
                  let action = Action(rawValue: String(entry[entry.index(after: colon)...])) else {
                throw BenchmarkError("\(environmentVariable)='\(value)': expected entries "
                    + "<compute units|candidate id|*>:<sigkill|abort|exit|hang> separated by ';'")
            }
            let target = String(entry[..<colon])
            if target == "*" || target == candidate.computeUnits.rawValue || target == candidate.id {
                return FaultInjection(action: action)
            }
        }
        return nil
    }

    func fire() {
        switch action {
        case .sigkill: raise(SIGKILL)
        case .abort: abort()
        case .exit: exit(3)
        case .hang: while true { sleep(60) }
        }
    }
}

/// A runtime whose models fire a `FaultInjection` at their first prediction.
final class FaultInjectingRuntime: ModelRuntime, @unchecked Sendable {
    let base: ModelRuntime
    let fault: FaultInjection
    var name: String { base.name }

    init(base: ModelRuntime, fault: FaultInjection) {
        self.base = base
        self.fault = fault
    }

    func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        FaultInjectingModel(base: try await base.loadModel(at: package, functionName: functionName, computeUnits: computeUnits),
                            fault: fault)
    }
}

final class FaultInjectingModel: RuntimeModel, @unchecked Sendable {
    let base: RuntimeModel
    let fault: FaultInjection
    var functionName: String { base.functionName }
    var io: ModelIO { base.io }

    init(base: RuntimeModel, fault: FaultInjection) {
        self.base = base
        self.fault = fault
    }

    func makeState() throws -> RuntimeState { try base.makeState() }

    func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
        fault.fire()
        return try await base.predict(inputs, state: state)
    }
}
