@testable import CohereTranscribe
import Foundation
import XCTest

/// The VAD through the transcriber: the block calls (N rows from the manifest, the state carried as plain arrays,
/// each row the 64 samples before its chunk then the chunk), the regions and windows by the rule, only those
/// windows transcribed, at their offsets on the audio's timeline; the stream's chunk calls; the modes. The test
/// bundle's encoder and decoder run on the interpreter; its vad.mlpackage is faked (`FakeVADRuntime`) with a
/// probability that follows the chunk's loudness, so the expected regions follow from the audio alone.
final class VADTranscriberTests: XCTestCase {
    /// Rows of the fake's block function: not the export's, so a loop that assumed another N fails.
    static let blockChunks = 7
    static let loud: Float = 0.01

    /// The fake's probability of one frame (64 context + 512 samples): high when the chunk's RMS is above `loud`,
    /// nudged by its context (so a stream that lost its context gives other probabilities).
    static func probability(_ frame: ArraySlice<Float>) -> Float {
        let chunk = frame.suffix(512)
        let rms = (chunk.reduce(0) { $0 + Double($1) * Double($1) } / Double(chunk.count)).squareRoot()
        let context = frame.prefix(64).reduce(0) { $0 + Double($1) }
        return Float((rms > Double(loud) ? 0.9 : 0.05) + 0.01 * tanh(context))
    }

    /// Serves every package from `base` but vad.mlpackage, whose functions are `FakeVAD`s. Records each call.
    final class FakeVADRuntime: ModelRuntime, @unchecked Sendable {
        let base: ModelRuntime
        let manifest: BundleManifest
        let lock = NSLock()
        var calls: [(function: String, rows: Int, h: Float, c: Float)] = []
        var violations: [String] = []
        var name: String { "fake-vad over \(base.name)" }

        init(base: ModelRuntime, manifest: BundleManifest) { (self.base, self.manifest) = (base, manifest) }

        func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
            guard package.lastPathComponent == manifest.files.vad else {
                return try await base.loadModel(at: package, functionName: functionName, computeUnits: computeUnits)
            }
            let function = functionName ?? VoiceActivity.blockFunction
            let chunks = manifest.vad!.functions[function]!.chunks
            return FakeVAD(runtime: self, functionName: function, io: manifest.expectedVADIO(chunks: chunks)!)
        }
    }

    /// probability: `VADTranscriberTests.probability` of each row; h_out = h + 1, c_out = c + 2 (so the calls'
    /// inputs show whether the state was carried); a row whose context is not the previous row's last 64
    /// samples is recorded as a violation.
    final class FakeVAD: RuntimeModel, @unchecked Sendable {
        let runtime: FakeVADRuntime
        let functionName: String
        let io: ModelIO

        init(runtime: FakeVADRuntime, functionName: String, io: ModelIO) {
            (self.runtime, self.functionName, self.io) = (runtime, functionName, io)
        }

        func makeState() throws -> RuntimeState { throw TranscriptionError.runtime("the VAD has no MLState") }

        func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
            let rows = io.inputs["frames"]!.shape[0]
            guard state == nil, let frames = inputs["frames"], frames.shape == [rows, 576], frames.dtype == .float32,
                  let h = inputs["h"], h.shape == [1, 128], let c = inputs["c"], c.shape == [1, 128] else {
                throw TranscriptionError.invalidArgument("fake VAD: not (\(rows), 576) frames and (1, 128) h, c: \(inputs)")
            }
            let x = frames.floats()
            var probabilities: [Float] = []
            for r in 0..<rows {
                let row = x[(r * 576)..<((r + 1) * 576)]
                if r > 0, Array(row.prefix(64)) != Array(x[(r * 576 - 64)..<(r * 576)]) {
                    runtime.lock.withLock { runtime.violations.append("\(functionName) row \(r): context is not the last chunk's end") }
                }
                probabilities.append(VADTranscriberTests.probability(row))
            }
            let (hs, cs) = (h.floats(), c.floats())
            runtime.lock.withLock { runtime.calls.append((functionName, rows, hs[0], cs[0])) }
            return ["probability": try Tensor(float32: probabilities, shape: [1, rows]),
                    "h_out": try Tensor(float32: hs.map { $0 + 1 }, shape: [1, 128]),
                    "c_out": try Tensor(float32: cs.map { $0 + 2 }, shape: [1, 128])]
        }
    }

    /// The test bundle with its own VAD replaced by a `vad` entry of a block of `blockChunks` rows and an (empty)
    /// vad.mlpackage folder (the fake's).
    static func vadBundle() throws -> URL {
        _ = try Fixtures.require()
        let source = Fixtures.bundle
        var json = VADManifestTests.withoutVAD(
            try JSONSerialization.jsonObject(with: Data(contentsOf: source.appendingPathComponent("manifest.json"))) as! [String: Any])
        json["vad"] = VADManifestTests.vadEntry(chunks: blockChunks)
        var files = json["files"] as! [String: Any]
        files["vad"] = "vad.mlpackage"
        json["files"] = files
        let dir = Fixtures.scratch.appendingPathComponent("cohere-swift-vad-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir.appendingPathComponent("vad.mlpackage"), withIntermediateDirectories: true)
        for name in try FileManager.default.contentsOfDirectory(atPath: source.path)
        where name != "manifest.json" && !VADManifestTests.isVADFile(name) {
            try FileManager.default.copyItem(at: source.appendingPathComponent(name), to: dir.appendingPathComponent(name))
        }
        try JSONSerialization.data(withJSONObject: json).write(to: dir.appendingPathComponent("manifest.json"))
        return dir
    }

    /// Low noise (never digital silence, never loud), seeded.
    static func noise(_ count: Int, seed: UInt64) -> [Float] {
        var g = SplitMix64(seed: seed)
        return (0..<count).map { _ in Float(Int(g.next() % 2001) - 1000) * 1e-6 }
    }

    /// noise 0.5 s, clip A, noise 4 s (longer than the 2 s gap a window bridges), clip B, noise 0.5 s.
    static func sparseAudio() throws -> (samples: [Float], clips: [Range<Int>]) {
        let dir = try Fixtures.require().appendingPathComponent("wav")
        let a = try AudioInput.load(contentsOf: dir.appendingPathComponent("en_heldout_00002.wav")).samples
        let b = try AudioInput.load(contentsOf: dir.appendingPathComponent("en_heldout_00020.wav")).samples
        var x = noise(8000, seed: 1)
        let ra = x.count..<(x.count + a.count)
        x += a + noise(64000, seed: 2)
        let rb = x.count..<(x.count + b.count)
        x += b + noise(8000, seed: 3)
        return (x, [ra, rb])
    }

    func testOnlyTheSpeechWindowsAreTranscribedOnTheAudiosTimeline() async throws {
        let bundle = try Self.vadBundle()
        let manifest = try BundleManifest.load(bundle: bundle)
        let runtime = FakeVADRuntime(base: try Fixtures.interpreter(), manifest: manifest)
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let (samples, clips) = try Self.sparseAudio()
        let result = try await transcriber.transcribe(samples: samples, language: "en")  // auto: the bundle has a VAD

        // the block calls: ceil(chunks / N) of N rows, from a zero state, carried from call to call
        let chunks = (samples.count + 511) / 512
        let calls = runtime.lock.withLock { runtime.calls }
        XCTAssertEqual(calls.count, (chunks + Self.blockChunks - 1) / Self.blockChunks)
        XCTAssertTrue(calls.allSatisfy { $0.function == "block" && $0.rows == Self.blockChunks })
        XCTAssertEqual(calls.map(\.h), (0..<calls.count).map(Float.init))
        XCTAssertEqual(calls.map(\.c), (0..<calls.count).map { Float(2 * $0) })
        XCTAssertEqual(runtime.lock.withLock { runtime.violations }, [])

        // the regions and windows of the rule, from the chunks' probabilities (the last chunk zero-padded)
        let frames = VoiceActivity.frames(samples[...], before: [], chunk: 512, context: 64)
        let probabilities = (0..<chunks).map { Self.probability(frames[($0 * 576)..<(($0 + 1) * 576)]) }
        // the window: the bundle's audio.max_audio_clip_s, or the encoder's frames when they hold less
        let a = manifest.audio
        let window = min(a.maxAudioClipSeconds, Double(manifest.encoder.windowFrames * a.hopLength) / 16000)
        let regions = speechRegions(probabilities, sampleCount: samples.count, maxSpeechSeconds: window)
        XCTAssertEqual(result.speechRegions, regions)
        let windows = try XCTUnwrap(result.speechWindows)
        XCTAssertEqual(windows, try packWindows(regions, sampleCount: samples.count, windowSamples: Int((window * 16000).rounded()),
                                                maxGapSamples: 32000))
        // one window per clip (the 4 s pause is not bridged), each within its clip and the pads around it
        XCTAssertEqual(windows.count, 2)
        for (w, clip) in zip(windows, clips) {
            XCTAssertTrue(w.start >= clip.lowerBound - 512 - 480 && w.end <= clip.upperBound + 512 + 480, "\(w) vs \(clip)")
        }
        // each window transcribed as its samples alone are, at its offset on the audio's timeline
        XCTAssertEqual(result.windows.count, 2)
        for (i, (window, span)) in zip(result.windows, windows).enumerated() {
            XCTAssertEqual(window.index, i)
            XCTAssertEqual(window.startSeconds, Double(span.start) / 16000)
            XCTAssertEqual(window.durationSeconds, Double(span.count) / 16000)
            let alone = try await transcriber.transcribe(samples: Array(samples[span.start..<span.end]), language: "en", vad: .off)
            XCTAssertEqual([window.tokenIds], alone.tokenIds)
            XCTAssertFalse(window.tokenIds.isEmpty)
        }
        let summary = try XCTUnwrap(result.vadSummary)
        XCTAssertEqual(summary.windows, 2)
        XCTAssertEqual(summary.regions, regions.count)
        XCTAssertEqual(summary.decodedSeconds, Double(windows.reduce(0) { $0 + $1.count }) / 16000)
        XCTAssertLessThan(summary.decodedShare, 0.75)

        // off: the whole audio by the energy rules, no VAD call
        let before = runtime.lock.withLock { runtime.calls.count }
        let off = try await transcriber.transcribe(samples: samples, language: "en", vad: .off)
        XCTAssertNil(off.speechRegions)
        XCTAssertNil(off.vadSummary)
        XCTAssertEqual(off.windows.map(\.startSeconds), AudioSplitter.splitPoints(samples, manifest: manifest).map { Double($0.lowerBound) / 16000 })
        XCTAssertEqual(runtime.lock.withLock { runtime.calls.count }, before)
    }

    /// No speech (low noise, not digital silence): an empty transcript, no window; digital silence keeps its
    /// shortcut (no model call at all).
    func testAudioWithoutSpeechGivesNoWindow() async throws {
        let bundle = try Self.vadBundle()
        let runtime = FakeVADRuntime(base: try Fixtures.interpreter(), manifest: try BundleManifest.load(bundle: bundle))
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let quiet = try await transcriber.transcribe(samples: Self.noise(80000, seed: 4), language: "en", vad: .on)
        XCTAssertEqual(quiet.text, "")
        XCTAssertEqual(quiet.windows.count, 0)
        XCTAssertEqual(quiet.speechRegions, [])
        XCTAssertFalse(quiet.silent)
        XCTAssertEqual(runtime.lock.withLock { runtime.calls.count }, (80000 / 512 + 1 + Self.blockChunks - 1) / Self.blockChunks)
        let before = runtime.lock.withLock { runtime.calls.count }
        let silent = try await transcriber.transcribe(samples: [Float](repeating: 0, count: 16000), language: "en", vad: .on)
        XCTAssertTrue(silent.silent)
        XCTAssertNil(silent.speechRegions)
        XCTAssertEqual(runtime.lock.withLock { runtime.calls.count }, before)
    }

    /// `.on` with a bundle without a VAD, and options out of range, are errors before any work (the file named
    /// does not exist: the VAD error comes first).
    func testModeAndOptionErrorsComeBeforeAnyWork() async throws {
        let noVAD = try VADManifestTests.bundleWithoutVAD()
        let plain = try await CohereTranscriber(bundle: noVAD, runtime: try Fixtures.interpreter())
        let missing = URL(fileURLWithPath: "/nonexistent/audio.wav")
        do {
            _ = try await plain.transcribe(contentsOf: missing, language: "en", vad: .on)
            XCTFail("vad .on accepted without a VAD")
        } catch {
            XCTAssertEqual("\(error)", "bundle \(noVAD.path) has no vad.mlpackage: re-export with "
                           + "`cohere-coreml export --vad` (the default)")
        }
        XCTAssertFalse(try plain.usesVAD(.auto))
        let bundle = try Self.vadBundle()
        let transcriber = try await CohereTranscriber(
            bundle: bundle, runtime: FakeVADRuntime(base: try Fixtures.interpreter(), manifest: try BundleManifest.load(bundle: bundle)))
        XCTAssertTrue(try transcriber.usesVAD(.auto))
        do {
            _ = try await transcriber.transcribe(contentsOf: missing, language: "en", vadOptions: VADOptions(threshold: 1.5))
            XCTFail("a threshold of 1.5 accepted")
        } catch {
            XCTAssertTrue("\(error)".contains("VAD threshold must be between 0 and 1"), "\(error)")
        }
    }

    /// The command line: `--vad on` with a bundle without a VAD, a bad `--vad` value or `--vad-*` option is one
    /// line on stderr naming the problem and the fix, exit status 2, before any model loads.
    func testCLIRefusesBadVADArgumentsInOneLine() throws {
        #if os(macOS) || os(Linux)
        let cli = try Fixtures.swiftCLI()
        let wav = try Fixtures.require().appendingPathComponent("wav/en_heldout_00002.wav").path
        let bundle = try VADManifestTests.bundleWithoutVAD()
        let cases: [([String], String)] = [
            (["--vad", "on"], "bundle \(bundle.path) has no vad.mlpackage: re-export with `cohere-coreml export --vad` (the default)"),
            (["--vad", "maybe"], "--vad must be auto, on or off, got 'maybe'"),
            (["--vad-threshold", "2"], "VAD threshold must be between 0 and 1 (exclusive), got 2.0"),
            (["--vad-min-silence-ms", "-5"], "VAD min_silence_ms must be a whole number of milliseconds >= 0, got -5"),
            (["--vad-speech-pad-ms", "2.5"], "--vad-speech-pad-ms needs a whole number of milliseconds"),
        ]
        for (arguments, message) in cases {
            let process = Process()
            process.executableURL = cli
            process.arguments = ["--bundle", bundle.path, "--language", "en", "--runtime", "interpreter",
                                 "--interpreter", "/nonexistent/cohere-coreml"] + arguments + [wav]
            let err = Pipe()
            process.standardError = err
            process.standardOutput = Pipe()
            try process.run()
            let stderr = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            process.waitUntilExit()
            XCTAssertEqual(process.terminationStatus, 2, "\(arguments)")
            XCTAssertEqual(stderr, "cohere-transcribe-swift: error: \(message)\n", "\(arguments)")
        }
        #else
        throw XCTSkip("the command line \(Fixtures.noChildProcesses)")
        #endif
    }

    /// The stream's probabilities (one `chunk` call a chunk, the state and context carried over pushes of any
    /// size) are the whole signal's.
    func testStreamProbabilitiesAreTheWholeSignals() async throws {
        let bundle = try Self.vadBundle()
        let manifest = try BundleManifest.load(bundle: bundle)
        let runtime = FakeVADRuntime(base: try Fixtures.interpreter(), manifest: manifest)
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let (samples, _) = try Self.sparseAudio()
        let whole = try await transcriber.speechProbabilities(samples)
        runtime.lock.withLock { runtime.calls = [] }
        let stream = VoiceActivity.Stream(chunk: try await transcriber.vadModel(VoiceActivity.chunkFunction).0, vad: manifest.vad!)
        var streamed: [Float] = []
        var at = 0, size = 1
        while at < samples.count {  // pushes of 1, 2, 3 ... 999 samples
            let end = min(samples.count, at + size)
            streamed += try await stream.push(Array(samples[at..<end]))
            (at, size) = (end, size % 999 + 1)
        }
        streamed += try await stream.push([Float](repeating: 0, count: (512 - samples.count % 512) % 512))
        XCTAssertEqual(streamed, whole)
        let calls = runtime.lock.withLock { runtime.calls }
        XCTAssertEqual(calls.count, whole.count)
        XCTAssertTrue(calls.allSatisfy { $0.function == "chunk" && $0.rows == 1 })
        XCTAssertEqual(calls.map(\.h), (0..<calls.count).map(Float.init))
        XCTAssertEqual(runtime.lock.withLock { runtime.violations }, [])
    }
}
