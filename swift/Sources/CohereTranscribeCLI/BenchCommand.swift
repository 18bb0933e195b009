// `cohere-transcribe-swift bench`: a thin wrapper over `DeviceBenchmark` (the library's benchmark).
import CohereTranscribe
import Foundation

enum BenchCommand {
    static let usage = """
    usage: cohere-transcribe-swift bench --bundle DIR --data DATASET [--out FILE.json]
                                         [--runtime coreml|interpreter] [--interpreter PATH]
                                         [--compute-units all|cpu_only|cpu_and_gpu|cpu_and_ne]
                                         [--language-from-manifest | --language LANG] [--max-clips N]
                                         [--max-new-tokens N] [--no-warmup] [--quiet] [--cache-dir DIR]
                                         [--candidates UNITS,...] [--device-choice FILE] [--child-timeout S]
                                         [--vad auto|on|off]

    Device benchmark of one bundle over a dataset folder (manifest.json / manifest.jsonl with file|audio, text,
    language: the format `cohere-coreml bench --data` reads): cold load (first transcriber + prewarm; with
    Core ML this compiles the packages unless they are cached) and warm load (a second transcriber) apart,
    then every clip (the first once more before, as warm-up): per-stage times, RTFx, tokens/s, ms per decoder
    call, token ids and stop reasons per window, memory after each clip, and (Core ML, macOS 14.4 / iOS 17.4)
    the compute plan's placement of every package function. Score it and compare it with the other engines:
      cohere-coreml bench --data DATASET --merge-engine FILE.json [--pytorch MODEL --bundle DIR ...]
      --data           dataset folder (its manifest's sha256 is recorded: the merge checks it)
      --out            write the JSON there (default: print it on stdout)
      --runtime        coreml (default on macOS) or interpreter (`cohere-coreml serve-runtime`, a child process:
                       macOS and Linux only; the default on Linux, where `coreml` runs Core ML's code path over the
                       emulation: placement unavailable)
      --interpreter    path of the cohere-coreml command (default: $COHERE_COREML, else PATH)
      --cache-dir      folder of compiled Core ML models (default: the user's Caches/CohereTranscribe/compiled)
    With Core ML the device decides: every candidate (compute units x each package layout the bundle holds) runs in a
    child process of its own, so a Neural Engine compile failure that kills the process is recorded, not a crash;
    device-choice.json gets every candidate's figures and the chosen one (the fastest that completed with the
    reference's token ids; docs/swift.md), which CohereTranscriber then uses. The JSON (--out / stdout) is the
    chosen candidate's. The interpreter runs once, in this process (it has no compute units).
      --candidates     compute units to try (comma-separated; default: cpu_only,cpu_and_gpu,cpu_and_ne,all)
      --compute-units  one candidate: these compute units for every component
      --device-choice  where device-choice.json goes (default: Application Support/CohereTranscribe/device-choice/
                       <manifest sha256 prefix>.json, where CohereTranscriber looks); the candidates' bench JSONs go
                       to <FILE without .json>.candidates/
      --child-timeout  seconds one candidate may run before it is killed and recorded as "timeout" (default 7200)
      --language-from-manifest  prompt each clip in its manifest language (the default)
      --language       prompt every clip in LANG instead (scoring still uses the manifest's language)
      --max-clips      only the first N manifest entries
      --no-warmup      no warm-up run of the first clip
      --quiet          no progress lines on stderr
      --vad            transcribe only the windows of speech the bundle's vad.mlpackage finds (docs/vad.md); auto =
                       on when the bundle has one (default: auto)
    Exit status: 0, 1 when a clip failed (it is in the JSON with its error; the others ran) or no candidate was
    chosen, 2 for usage errors and when the benchmark cannot run (dataset, bundle, runtime).
    """

    static func fail(_ message: String) -> Int32 {
        FileHandle.standardError.write(Data("cohere-transcribe-swift bench: error: \(message)\n".utf8))
        return 2
    }

    static func run(_ arguments: [String]) async -> Int32 {
        var args = arguments
        var bundle: String?, data: String?, out: String?, interpreterPath: String?, language: String?
        var units: ComputeUnits?, maxClips: Int?, maxNewTokens: Int?
        var fromManifest = false, warmup = true, quiet = false
        var cacheDir: String?, candidateUnits: [ComputeUnits]?, deviceChoicePath: String?, childTimeout = 7200.0
        var childCandidate: String?, childResult: String?
        var runtimeName = RuntimeChoice.defaultName
        var vad = VADMode.auto
        while !args.isEmpty {
            let a = args.removeFirst()
            func value() -> String? { args.isEmpty ? nil : args.removeFirst() }
            func positive() -> Int? { value().flatMap { Int($0) }.flatMap { $0 >= 1 ? $0 : nil } }
            switch a {
            case "-h", "--help":
                print(usage)
                return 0
            case "--bundle", "--data", "--out", "--interpreter", "--language", "--runtime", "--compute-units", "--cache-dir",
                 "--candidates", "--device-choice", "--child-timeout", "--child-candidate", "--child-result":
                guard let v = value() else { return fail("\(a) needs a value") }
                switch a {
                case "--cache-dir": cacheDir = v
                case "--device-choice": deviceChoicePath = v
                case "--child-candidate": childCandidate = v
                case "--child-result": childResult = v
                case "--child-timeout":
                    guard let t = Double(v), t.isFinite, t > 0 else { return fail("--child-timeout needs a positive number of seconds") }
                    childTimeout = t
                case "--candidates":
                    var list: [ComputeUnits] = []
                    for item in v.split(separator: ",", omittingEmptySubsequences: false) {
                        guard let u = ComputeUnits(rawValue: String(item)) else {
                            return fail("--candidates: '\(item)' is not one of \(ComputeUnits.allCases.map(\.rawValue).joined(separator: ", "))")
                        }
                        list.append(u)
                    }
                    candidateUnits = list
                case "--bundle": bundle = v
                case "--data": data = v
                case "--out": out = v
                case "--interpreter": interpreterPath = v
                case "--language": language = v
                case "--runtime":
                    guard ["coreml", "interpreter"].contains(v) else { return fail("--runtime must be coreml or interpreter, got '\(v)'") }
                    runtimeName = v
                default:
                    guard let u = ComputeUnits(rawValue: v) else {
                        return fail("--compute-units must be one of \(ComputeUnits.allCases.map(\.rawValue).joined(separator: ", ")), got '\(v)'")
                    }
                    units = u
                }
            case "--max-clips":
                guard let n = positive() else { return fail("--max-clips needs a positive integer") }
                maxClips = n
            case "--max-new-tokens":
                guard let n = positive() else { return fail("--max-new-tokens needs a positive integer") }
                maxNewTokens = n
            case "--language-from-manifest": fromManifest = true
            case "--no-warmup": warmup = false
            case "--quiet": quiet = true
            case "--vad":
                let v = value() ?? ""
                guard let mode = VADMode(rawValue: v) else { return fail("--vad must be auto, on or off, got '\(v)'") }
                vad = mode
            default:
                return fail("unknown argument '\(a)'\n\(usage)")
            }
        }
        guard let bundle else { return fail("--bundle is required\n\(usage)") }
        guard let data else { return fail("--data is required\n\(usage)") }
        if fromManifest && language != nil { return fail("--language and --language-from-manifest exclude each other") }
        if units != nil && candidateUnits != nil { return fail("--compute-units and --candidates exclude each other") }
        if (childCandidate == nil) != (childResult == nil) { return fail("--child-candidate and --child-result go together") }
        if runtimeName == "interpreter" && childCandidate == nil
            && (candidateUnits != nil || deviceChoicePath != nil) {
            return fail("--candidates and --device-choice need --runtime coreml (the interpreter has no compute units)")
        }
        if vad == .on {  // a bundle without vad.mlpackage: one line, before any child, runtime or model
            do {
                let url = URL(fileURLWithPath: bundle)
                let manifest = try BundleManifest.load(bundle: url)
                _ = try vad.resolve(bundleHasVAD: manifest.vad != nil && manifest.files.vad != nil, bundle: url)
            } catch {
                return fail("\(error)")
            }
        }
        if runtimeName == "coreml" && childCandidate == nil {  // the device decides: one child per candidate
            #if os(macOS) || os(Linux)
            var childArguments = ["--bundle", bundle, "--data", data, "--runtime", "coreml", "--quiet"]
            if let interpreterPath { childArguments += ["--interpreter", interpreterPath] }
            if let cacheDir { childArguments += ["--cache-dir", cacheDir] }
            if let language { childArguments += ["--language", language] }
            if let maxClips { childArguments += ["--max-clips", String(maxClips)] }
            if let maxNewTokens { childArguments += ["--max-new-tokens", String(maxNewTokens)] }
            if !warmup { childArguments.append("--no-warmup") }
            if vad != .auto { childArguments += ["--vad", vad.rawValue] }
            return await sweep(bundle: bundle, childArguments: childArguments, units: units.map { [$0] } ?? candidateUnits,
                               deviceChoice: deviceChoicePath, timeout: childTimeout, out: out, quiet: quiet)
            #else
            return fail("the candidate sweep needs child processes (macOS, Linux)")
            #endif
        }

        let runtime: ModelRuntime
        do {  // on Linux `coreml` is Core ML's code path over the emulation (placement: unavailable)
            runtime = try RuntimeChoice.make(runtimeName, interpreterPath: interpreterPath, cacheDir: cacheDir)
        } catch {
            return fail("\(error)")
        }
        var progress: (@Sendable (String) -> Void)?
        if !quiet {
            progress = { line in FileHandle.standardError.write(Data("bench: \(line)\n".utf8)) }
        }
        var options = DeviceBenchmark.Options(bundle: URL(fileURLWithPath: bundle), dataset: data, computeUnitsFlag: units,
                                              language: language, maxClips: maxClips, maxNewTokens: maxNewTokens,
                                              warmup: warmup, progress: progress)
        options.vad = vad
        let report: DeviceBenchmark.Report
        let json: Data
        do {
            if let childCandidate, let childResult {  // a child of the sweep: one candidate, its report to a file
                let all = try DeviceCandidate.all(bundle: URL(fileURLWithPath: bundle))
                guard let candidate = all.first(where: { $0.id == childCandidate }) else {
                    return fail("--child-candidate '\(childCandidate)' is not a candidate of \(bundle) (they are: "
                        + all.map(\.id).joined(separator: "; ") + ")")
                }
                options.candidate = candidate
                options.computeUnits = candidate.components
                options.computeUnitsFlag = candidate.computeUnits
                options.fault = try FaultInjection.from(environment: ProcessInfo.processInfo.environment, candidate: candidate)
                let r = try await DeviceBenchmark.run(options, runtime: runtime)
                try r.json().write(to: URL(fileURLWithPath: childResult), options: .atomic)
                return 0
            }
            report = try await DeviceBenchmark.run(options, runtime: runtime)
            json = try report.json()
        } catch {
            return fail("\(error)")
        }
        if let out {
            do {
                let url = URL(fileURLWithPath: out)
                try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
                try json.write(to: url, options: .atomic)
            } catch {
                return fail("cannot write \(out): \(error.localizedDescription)")
            }
            print(summary(report, out: out))
        } else {
            print(String(decoding: json, as: UTF8.self))
        }
        for clip in report.clips where clip.status == "problem" {
            FileHandle.standardError.write(Data("cohere-transcribe-swift bench: clip \(clip.id): \(clip.problem ?? "failed")\n".utf8))
        }
        return report.failedClips == 0 ? 0 : 1
    }

    #if os(macOS) || os(Linux)
    /// The candidate sweep (DeviceSweep): device-choice.json, then the chosen candidate's report to --out or stdout.
    static func sweep(bundle: String, childArguments: [String], units: [ComputeUnits]?, deviceChoice: String?,
                      timeout: Double, out: String?, quiet: Bool) async -> Int32 {
        let bundleURL = URL(fileURLWithPath: bundle)
        let result: DeviceSweep.Result
        do {
            _ = try BundleManifest.load(bundle: bundleURL)
            let candidates = try DeviceCandidate.all(bundle: bundleURL, units: units)
            let output: URL
            if let deviceChoice { output = URL(fileURLWithPath: deviceChoice) } else {
                output = try DeviceChoice.defaultLocation(bundle: bundleURL)
            }
            var progress: (@Sendable (String) -> Void)?
            if !quiet {
                progress = { line in FileHandle.standardError.write(Data("bench: \(line)\n".utf8)) }
            }
            result = try DeviceSweep.run(DeviceSweep.Options(
                executable: DeviceSweep.currentExecutable(), childArguments: childArguments, bundle: bundleURL,
                candidates: candidates, output: output, timeout: timeout, forwardChildOutput: !quiet, progress: progress))
        } catch {
            return fail("\(error)")
        }
        for entry in result.document["candidates"] as? [[String: Any]] ?? [] where entry["status"] as? String != "completed" {
            let id = entry["id"] as? String ?? "?", status = entry["status"] as? String ?? "?"
            let problem = entry["problem"] as? String ?? ""
            FileHandle.standardError.write(Data("cohere-transcribe-swift bench: candidate \(id): \(status): \(problem)\n".utf8))
        }
        guard let chosen = result.chosenReport, let data = try? Data(contentsOf: chosen) else {
            let message = "cohere-transcribe-swift bench: no candidate completed with the reference's token ids: nothing "
                + "chosen (device-choice.json says why per candidate)\n"
            FileHandle.standardError.write(Data(message.utf8))
            return 1
        }
        let failed = ((try? JSONSerialization.jsonObject(with: data) as? [String: Any])?["clips"] as? [[String: Any]] ?? [])
            .filter { $0["status"] as? String == "problem" }.count
        if let out {
            do {
                let url = URL(fileURLWithPath: out)
                try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
                try data.write(to: url, options: .atomic)
            } catch {
                return fail("cannot write \(out): \(error.localizedDescription)")
            }
            print("chosen \(result.chosen?.id ?? "-"); wrote \(out) (its bench JSON) and the device choice")
        } else {
            print(String(decoding: data, as: UTF8.self))
        }
        return failed == 0 ? 0 : 1
    }
    #endif

    static func summary(_ r: DeviceBenchmark.Report, out: String) -> String {
        func f(_ x: Double?, _ digits: Int = 2) -> String { x.map { String(format: "%.\(digits)f", $0) } ?? "-" }
        let t = r.totals
        var lines = [
            "bundle \(r.bundle.dir) (\(r.bundle.precision ?? "?")), \(r.runtime), \(r.machine.device) \(r.machine.chip ?? "") "
                + "\(r.machine.os) \(r.machine.osVersion)",
            "dataset \(r.dataset.name): \(t.clips) clips (\(t.clipsOK) ok, \(t.clipsSilent) silent, \(t.clipsFailed) failed), "
                + "\(f(t.audioSeconds, 1)) s of audio, manifest sha256 \(r.dataset.manifestSHA256.prefix(12))",
            "load: cold \(f(r.load.cold)) s, warm \(f(r.load.warm)) s; first run \(f(r.firstRunSeconds)) s",
            "RTFx \(f(t.rtfx)), \(f(t.tokensPerSecond, 1)) tokens/s, \(f(t.msPerDecoderCall)) ms per decoder call; stages s: "
                + ["features_s", "encoder_s", "prompt_s", "decode_s"].map { "\($0.dropLast(2)) \(f(t.stages[$0]))" }
                .joined(separator: ", "),
            "memory (\(r.memory.measure)): peak \(f(r.memory.peakMB, 0)) MB"
                + (r.memory.interpreterChildPeakMB.map { ", interpreter child peak \(f($0, 0)) MB" } ?? ""),
        ]
        switch r.placement {
        case .unavailable:
            lines.append("placement: unavailable (\(r.placementReason ?? ""))")
        case .functions(let rows):
            for row in rows {
                lines.append("placement \(row.package) \(row.function): " + (row.error ?? (
                    "\(row.operations) ops, Neural Engine \(f(row.costShare["neural_engine"].map { 100 * $0 }, 1)) % of cost, "
                        + "\(row.notOnNeuralEngine.count) ops elsewhere")))
            }
        }
        lines.append("wrote \(out); score it with: cohere-coreml bench --data \(r.dataset.name) --merge-engine \(out)")
        return lines.joined(separator: "\n")
    }
}
