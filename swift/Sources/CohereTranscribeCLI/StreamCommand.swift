// `cohere-transcribe-swift --stream FILE...`: live transcription of files (Python's `transcribe --stream`).
import CohereTranscribe
import Foundation

enum StreamCommand {
    /// Every file read, resampled and checked (missing, empty, corrupt, NaN) before the bundle loads, as
    /// Python's `run_cli` does; the first bad file is the error.
    static func load(_ files: [String], sampleRate: Int) throws -> [(String, [Float])] {
        try files.map { path in
            let audio = try AudioInput.load(contentsOf: URL(fileURLWithPath: path), sampleRate: sampleRate)
            _ = try AudioInput.isSilent(audio.samples, name: path)
            return (path, audio.samples)
        }
    }

    /// One JSON line per update with `json` (with several files each line starts with "audio"), else
    /// finals on stdout as `[start-end] text` and partials on stderr as `~ [start-end] text`. With `stats`, one
    /// JSON line of compute counters per file on stderr after its updates (Python's `--stats` line). With
    /// `wordTimestamps`, each final's words (JSON: its "words"; else one line per word after the final).
    static func run(_ transcriber: CohereTranscriber, files: [(String, [Float])], language: String, punctuation: Bool,
                    config: StreamConfig, json: Bool, pace: Bool, maxNewTokens: Int?, stats: Bool = false,
                    wordTimestamps: Bool = false, vad: VADMode = .auto, vadOptions: VADOptions = VADOptions()) async throws {
        let rate = transcriber.manifest.audio.samplingRate
        for (path, samples) in files {
            if files.count > 1, !json { print("== \(path)") }
            let audio = files.count > 1 ? path : nil
            var onStats: (@Sendable (StreamStats) -> Void)?
            if stats {
                onStats = { counters in
                    FileHandle.standardError.write(Data((counters.jsonLine(audio: audio) + "\n").utf8))
                }
            }
            let (input, updates) = try transcriber.stream(language: language, punctuation: punctuation, config: config,
                                                          maxNewTokens: maxNewTokens, wordTimestamps: wordTimestamps,
                                                          vad: vad, vadOptions: vadOptions, onStats: onStats)
            let feeder = Task { try await StreamFileSource.feed(samples: samples, sampleRate: rate, into: input, pace: pace) }
            for try await update in updates {
                if json {
                    var line = update.jsonLine()
                    if files.count > 1 {
                        line = "{\"audio\": \(JSONValue.quoted(path)), " + line.dropFirst()
                    }
                    print(line)
                } else if update.type == .final {
                    print("[\(String(format: "%.2f", update.start))-\(String(format: "%.2f", update.end))] \(update.text)")
                    for w in update.words ?? [] {
                        print("  [\(String(format: "%.3f", w.start))-\(String(format: "%.3f", w.end))] \(w.text) "
                              + "(\(String(format: "%.3f", w.probability)))")
                    }
                } else {
                    FileHandle.standardError.write(Data(
                        "~ [\(String(format: "%.2f", update.start))-\(String(format: "%.2f", update.end))] \(update.text)\n".utf8))
                }
                fflush(stdout)
            }
            try await feeder.value
        }
    }
}
