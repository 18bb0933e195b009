// `cohere-transcribe-swift bench`: a thin wrapper over `DeviceBenchmark` (the library's benchmark).
import CohereTranscribe
import Foundation

enum BenchCommand {
    static let usage = """
    usage: cohere-transcribe-swift bench --bundle DIR --data DATASET [--out FILE.json]
                                         [--runtime coreml|interpreter] [--interpreter PATH]
                                         [--compute-units all|cpu_only|cpu_and_gpu|cpu_and_ne]
                                         [--language-from-manifest | --language LANG] [--max-clips N]
                                         [--max-new-tokens N] [--no-warmup] [--quiet]

    Device benchmark of one bundle over a dataset folder (manifest.json / manifest.jsonl with file|audio, text,
    language: the format `cohere-coreml bench --data` reads): cold load (first transcriber + prewarm; with
    Core ML this compiles the packages unless they are cached) and warm load (a second transcriber) apart,
    then every clip (the first once more before, as warm-up): per-stage times, RTFx, tokens/s, ms per decoder
    call, token ids and stop reasons per window, memory after each clip, and (Core ML, macOS 14.4 / iOS 17.4)
    the compute plan's placement of every package function. Score it and compare it with the other engines:
      cohere-coreml bench --data DATASET --merge-engine FILE.json [--pytorch MODEL --bundle DIR ...]
      --data           dataset folder (its manifest's sha256 is recorded: the merge checks it)
      --out            write the JSON there (default: print it on stdout)
      --runtime        coreml (default on macOS) or interpreter (`cohere-coreml serve-runtime`; the default on
                       Linux, where `coreml` runs Core ML's code path over the emulation: placement unavailable)
      --interpreter    path of the cohere-coreml command (default: $COHERE_COREML, else PATH)
      --compute-units  Core ML compute units for every component (default: front end cpu_and_gpu, encoder and
                       decoder cpu_and_ne)
      --language-from-manifest  prompt each clip in its manifest language (the default)
      --language       prompt every clip in LANG instead (scoring still uses the manifest's language)
      --max-clips      only the first N manifest entries
      --no-warmup      no warm-up run of the first clip
      --quiet          no progress lines on stderr
    Exit status: 0, 1 when a clip failed (it is in the JSON with its error; the others ran), 2 for usage errors
    and when the benchmark cannot run (dataset, bundle, runtime).
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
        #if os(macOS)
        var runtimeName = "coreml"
        #else
        var runtimeName = "interpreter"
        #endif
        while !args.isEmpty {
            let a = args.removeFirst()
            func value() -> String? { args.isEmpty ? nil : args.removeFirst() }
            func positive() -> Int? { value().flatMap { Int($0) }.flatMap { $0 >= 1 ? $0 : nil } }
            switch a {
            case "-h", "--help":
                print(usage)
                return 0
            case "--bundle", "--data", "--out", "--interpreter", "--language", "--runtime", "--compute-units":
                guard let v = value() else { return fail("\(a) needs a value") }
                switch a {
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
            default:
                return fail("unknown argument '\(a)'\n\(usage)")
            }
        }
        guard let bundle else { return fail("--bundle is required\n\(usage)") }
        guard let data else { return fail("--data is required\n\(usage)") }
        if fromManifest && language != nil { return fail("--language and --language-from-manifest exclude each other") }

        let runtime: ModelRuntime
        do {
            if runtimeName == "interpreter" {
                runtime = try interpreterPath.map { try InterpreterRuntime(executable: URL(fileURLWithPath: $0)) }
                    ?? InterpreterRuntime()
            } else {
                #if os(Linux)
                CoreMLEmulation.use(try interpreterPath.map { try InterpreterRuntime(executable: URL(fileURLWithPath: $0)) }
                    ?? InterpreterRuntime())  // the Core ML code path over the emulation (placement: unavailable)
                #endif
                runtime = try CoreMLRuntime()
            }
        } catch {
            return fail("\(error)")
        }
        var progress: (@Sendable (String) -> Void)?
        if !quiet {
            progress = { line in FileHandle.standardError.write(Data("bench: \(line)\n".utf8)) }
        }
        let options = DeviceBenchmark.Options(bundle: URL(fileURLWithPath: bundle), dataset: data, computeUnitsFlag: units,
                                              language: language, maxClips: maxClips, maxNewTokens: maxNewTokens,
                                              warmup: warmup, progress: progress)
        let report: DeviceBenchmark.Report
        let json: Data
        do {
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
