// cohere-transcribe-swift: transcribe audio files with an exported bundle from Swift.
import CohereTranscribe
import Foundation

if CommandLine.arguments.count > 1, CommandLine.arguments[1] == "bench" {  // the device benchmark (BenchCommand.swift)
    exit(await BenchCommand.run(Array(CommandLine.arguments.dropFirst(2))))
}

let usage = """
usage: cohere-transcribe-swift --bundle DIR --language LANG FILE... [--json] [--no-punctuation] [--word-timestamps]
                               [--max-new-tokens N] [--compute-units all|cpu_only|cpu_and_gpu|cpu_and_ne]
                               [--runtime coreml|interpreter] [--interpreter PATH] [--cache-dir DIR] [--decoder-batch N]
                               [--vad auto|on|off] [--vad-threshold P] [--vad-min-speech-ms MS]
                               [--vad-min-silence-ms MS] [--vad-speech-pad-ms MS] [--vad-max-gap-s S]
       cohere-transcribe-swift --stream --bundle DIR --language LANG FILE... [--json] [--no-pace] [--hop S]
                               [--stats] [--word-timestamps] [--vad auto|on|off] [--vad-* ...]
       cohere-transcribe-swift bench --bundle DIR --data DATASET ...   (device benchmark: bench --help)

Greedy transcription with a bundle written by `cohere-coreml export` (front end, encoder, decoder
packages, manifest.json, vocab.json); token for token what `cohere-coreml transcribe` gives.
  --runtime        coreml (default on macOS) or interpreter (the project's MIL interpreter through
                   `cohere-coreml serve-runtime`, a child process: macOS and Linux only; the default on
                   Linux). On Linux `coreml` runs the same Core ML code path over the project's Core ML
                   emulation (backed by the interpreter).
  --interpreter    path of the cohere-coreml command (default: $COHERE_COREML, else PATH)
  --cache-dir      folder of compiled Core ML models (default: the user's Caches/CohereTranscribe/compiled)
  --compute-units  Core ML compute units for every component (default: the device choice `bench` wrote for
                   this bundle, else front end CPU/GPU, encoder and decoder Neural Engine)
  --device-choice  FILE: the device-choice.json to use (`bench` writes it); none: ignore any (default: the
                   one `bench` wrote for this bundle in Application Support, else <bundle>/device-choice.json)
  --json           print JSON shaped like `cohere-coreml transcribe --json`
  --decoder-batch  windows of a file decoded at once (greedy, without --word-timestamps): the bundle's
                   decoder.batch.size (default), or 1 (one window at a time)
  --word-timestamps each word's start and end (seconds) and probability: JSON "words" (per window and in all;
                   with --stream, each final's), else one line per word after the text (the bundle's
                   decoder.alignment, docs/word-timings.md)
  --stream         live transcription (`cohere-coreml transcribe --stream`): the file fed in 0.1 s chunks,
                   paced at real time; partial and final updates (--json: one JSON line per update)
  --no-pace        with --stream: feed the file as fast as possible
  --hop S          with --stream: seconds of new audio between partials (default 0.5)
  --stats          with --stream: after each file, one JSON line of compute counters on stderr (encoder
                   calls / frames, decoder calls / tokens fed, per audio second); stdout is unchanged
  --vad            voice activity (docs/vad.md): transcribe only the windows of speech the bundle's
                   vad.mlpackage finds (with --stream: segments opened and closed by it); auto = on when the
                   bundle has one (default: auto)
  --vad-threshold  speech probability at which speech starts, between 0 and 1 (default: 0.5)
  --vad-min-speech-ms   drop regions of speech shorter than this (default: 250)
  --vad-min-silence-ms  silence that ends a region of speech (default: 100)
  --vad-speech-pad-ms   audio kept on each side of a region (default: 30)
  --vad-max-gap-s  longest pause kept inside one window; longer pauses are never decoded (default: 2.0)
A file that cannot be transcribed is reported; the others are still transcribed (exit status 1).
"""

func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("cohere-transcribe-swift: error: \(message)\n".utf8))
    exit(2)
}

var bundle: String?
var language: String?
var files: [String] = []
var json = false
var wordTimestamps = false
var punctuation = true
var maxNewTokens: Int?
var decoderBatch: Int?
var units: ComputeUnits?
var interpreterPath: String?
var cacheDir: String?
var deviceChoice = DeviceChoice.Source.automatic
var stream = false
var pace = true
var hop: Double?
var stats = false
var runtimeName = RuntimeChoice.defaultName
var vadMode = VADMode.auto
var vadOptions = VADOptions()

var args = Array(CommandLine.arguments.dropFirst())
func value(_ flag: String) -> String {
    guard !args.isEmpty else { fail("\(flag) needs a value") }
    return args.removeFirst()
}
while !args.isEmpty {
    let a = args.removeFirst()
    switch a {
    case "-h", "--help": print(usage); exit(0)
    case "--bundle": bundle = value(a)
    case "--language": language = value(a)
    case "--json": json = true
    case "--word-timestamps": wordTimestamps = true
    case "--no-punctuation": punctuation = false
    case "--max-new-tokens":
        guard let n = Int(value(a)), n >= 1 else { fail("--max-new-tokens needs a positive integer") }
        maxNewTokens = n
    case "--decoder-batch":
        guard let n = Int(value(a)), n >= 1 else { fail("--decoder-batch needs a positive integer") }
        decoderBatch = n
    case "--compute-units":
        let v = value(a)
        guard let u = ComputeUnits(rawValue: v) else {
            fail("--compute-units must be one of \(ComputeUnits.allCases.map(\.rawValue).joined(separator: ", ")), got '\(v)'")
        }
        units = u
    case "--runtime":
        runtimeName = value(a)
        guard ["coreml", "interpreter"].contains(runtimeName) else { fail("--runtime must be coreml or interpreter") }
    case "--interpreter": interpreterPath = value(a)
    case "--cache-dir": cacheDir = value(a)
    case "--device-choice":
        let v = value(a)
        deviceChoice = v == "none" ? .none : .file(URL(fileURLWithPath: v))
    case "--stream": stream = true
    case "--no-pace": pace = false
    case "--stats": stats = true
    case "--hop":
        guard let s = Double(value(a)), s.isFinite, s > 0 else { fail("--hop needs a positive number of seconds") }
        hop = s
    case "--vad":
        let v = value(a)
        guard let mode = VADMode(rawValue: v) else { fail("--vad must be auto, on or off, got '\(v)'") }
        vadMode = mode
    case "--vad-threshold":
        guard let x = Double(value(a)) else { fail("--vad-threshold needs a number between 0 and 1") }
        vadOptions.threshold = x
    case "--vad-min-speech-ms", "--vad-min-silence-ms", "--vad-speech-pad-ms":
        guard let ms = Int(value(a)) else { fail("\(a) needs a whole number of milliseconds") }
        switch a {
        case "--vad-min-speech-ms": vadOptions.minSpeechMs = ms
        case "--vad-min-silence-ms": vadOptions.minSilenceMs = ms
        default: vadOptions.speechPadMs = ms
        }
    case "--vad-max-gap-s":
        guard let s = Double(value(a)) else { fail("--vad-max-gap-s needs a number of seconds") }
        vadOptions.maxGapSeconds = s
    default:
        if a.hasPrefix("--") { fail("unknown option \(a)\n\(usage)") }
        files.append(a)
    }
}
guard let bundle else { fail("--bundle is required\n\(usage)") }
guard let language else { fail("--language is required\n\(usage)") }
guard !files.isEmpty else { fail("no audio file given\n\(usage)") }
if !stream, !pace || hop != nil || stats { fail("--no-pace, --hop and --stats need --stream") }
do {  // bad --vad-* values, --vad on with a bundle without vad.mlpackage: one line, before any audio or model
    try vadOptions.validate()
    if vadMode == .on {
        let url = URL(fileURLWithPath: bundle)
        let manifest = try BundleManifest.load(bundle: url)
        _ = try vadMode.resolve(bundleHasVAD: manifest.vad != nil && manifest.files.vad != nil, bundle: url)
    }
    if let decoderBatch {  // another size than the bundle's: likewise
        _ = try CohereTranscriber.checkedBatch(decoderBatch, manifest: BundleManifest.load(bundle: URL(fileURLWithPath: bundle)),
                                               option: "--decoder-batch")
    }
} catch {
    fail("\(error)")
}
var streamConfig = StreamConfig()
if let hop { streamConfig.hopSeconds = hop }
var streamFiles: [(String, [Float])] = []
if stream {  // every file checked before the bundle loads
    do {
        let rate = try BundleManifest.load(bundle: URL(fileURLWithPath: bundle)).audio.samplingRate
        streamFiles = try StreamCommand.load(files, sampleRate: rate)
    } catch {
        fail("\(error)")
    }
}

/// A word as `cohere-coreml transcribe --word-timestamps --json` writes it (seconds to the millisecond).
func jsonWord(_ w: WordTiming) -> [String: Any] {
    func rounded(_ x: Double) -> Double { (x * 1000).rounded() / 1000 }
    return ["word": w.text, "start": rounded(w.start), "end": rounded(w.end), "probability": rounded(w.probability)]
}

/// One file's entry, as `cohere-coreml transcribe --json` writes it: "status" ok | silent | error.
func jsonObject(_ path: String, _ r: TranscriptionResult) -> [String: Any] {
    var object: [String: Any] = [
        "audio": path, "status": r.silent ? "silent" : "ok", "seconds": r.seconds, "text": r.text,
        "language": r.language, "punctuation": r.punctuation, "truncated": r.truncated, "silent": r.silent,
        "windows": r.windows.map { w -> [String: Any] in
            let t = w.timings
            return ["index": w.index, "start_s": w.startSeconds, "duration_s": w.durationSeconds, "token_ids": w.tokenIds,
                    "text": w.text, "truncated": w.truncated, "stop_reason": w.stopReason.rawValue,
                    "timings": (["features_s": t.featuresSeconds, "front_end": "package", "encoder_s": t.encoderSeconds,
                                 "encoder_function": t.encoderFunction, "bind_s": t.bindSeconds, "prompt_s": t.promptSeconds,
                                 "decode_s": t.decodeSeconds, "decoder_calls": t.decoderCalls,
                                 "ms_per_decoder_call": t.msPerDecoderCall] as [String: Any])
                        .merging(t.decoderBatch > 1 ? ["decoder_batch": t.decoderBatch] : [:]) { a, _ in a },  // as Python's
                    "decoding": ["beams": 1, "repetition": NSNull()]]
                .merging(w.words.map { ["words": $0.map(jsonWord)] } ?? [:]) { a, _ in a }
        },
    ]
    if let words = r.words { object["words"] = words.map(jsonWord) }
    if let v = r.vadSummary {  // as Python's result: the windows and the share of the audio decoded
        object["vad"] = ["windows": v.windows, "regions": v.regions, "audio_s": v.audioSeconds, "decoded_s": v.decodedSeconds,
                         "decoded_share": v.decodedShare]
    }
    return object
}

let transcriber: CohereTranscriber
do {
    let runtime = try RuntimeChoice.make(runtimeName, interpreterPath: interpreterPath, cacheDir: cacheDir)
    transcriber = try await CohereTranscriber(bundle: URL(fileURLWithPath: bundle), runtime: runtime,
                                              computeUnits: units.map { .uniform($0) }, deviceChoice: deviceChoice,
                                              decoderBatch: decoderBatch)
    let prompt = try transcriber.manifest.prompt(language: language, punctuation: punctuation)  // unknown language: fail now
    if wordTimestamps { _ = try transcriber.manifest.checkedAlignment(promptLength: prompt.count) }  // no alignment: likewise
} catch {
    fail("\(error)")
}

if stream {
    do {
        try await StreamCommand.run(transcriber, files: streamFiles, language: language, punctuation: punctuation,
                                    config: streamConfig, json: json, pace: pace, maxNewTokens: maxNewTokens,
                                    stats: stats, wordTimestamps: wordTimestamps, vad: vadMode, vadOptions: vadOptions)
    } catch {
        fail("\(error)")
    }
    exit(0)
}

var results: [[String: Any]] = []
var failures = 0
for path in files {
    do {
        let r = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: path), language: language,
                                                 punctuation: punctuation, maxNewTokens: maxNewTokens,
                                                 wordTimestamps: wordTimestamps, vad: vadMode, vadOptions: vadOptions)
        if json {
            results.append(jsonObject(path, r))
        } else {
            if files.count > 1 { print("== \(path)") }
            print(r.silent ? "(silent)" : r.text)
            for w in r.words ?? [] {
                print("[\(String(format: "%.3f", w.start))-\(String(format: "%.3f", w.end))] \(w.text) "
                      + "(\(String(format: "%.3f", w.probability)))")  // as `cohere-coreml transcribe` prints it
            }
            if let v = r.vadSummary {  // as `cohere-coreml transcribe` logs it
                FileHandle.standardError.write(Data(("vad: \(v.windows) window(s), \(String(format: "%.1f", v.decodedSeconds)) s of "
                    + "\(String(format: "%.1f", v.audioSeconds)) s decoded (\(String(format: "%.0f", 100 * v.decodedShare)) %)\n").utf8))
            }
            for w in r.windows where w.truncated {
                FileHandle.standardError.write(Data("window \(w.index) stopped without eos (\(w.stopReason))\n".utf8))
            }
        }
    } catch {
        failures += 1
        FileHandle.standardError.write(Data("cohere-transcribe-swift: \(path): \(error)\n".utf8))
        if json { results.append(["audio": path, "status": "error", "error": "\(error)"]) }
    }
}
if let coreML = transcriber.runtime as? CoreMLRuntime {
    let (compiled, cached) = coreML.cacheStatistics
    FileHandle.standardError.write(Data(
        "cohere-transcribe-swift: Core ML: \(compiled) package(s) compiled, \(cached) loaded compiled from \(coreML.cacheDirectory.path)\n".utf8))
}
if json {
    let object: Any = results.count == 1 ? results[0] : results
    let data = try JSONSerialization.data(withJSONObject: object, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes])
    print(String(decoding: data, as: UTF8.self))
}
exit(failures == 0 ? 0 : 1)
