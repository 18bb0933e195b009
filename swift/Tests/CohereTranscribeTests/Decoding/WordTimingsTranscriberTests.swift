@testable import CohereTranscribe
import Foundation
import XCTest

/// Word timings through the transcriber: the align call after a window's decoding, the rows and frames cut
/// from its output, the rule, the window offset and clamp, the probabilities from decoding. The test bundle's
/// decoder runs on the interpreter; its align function is faked (`FakeAlignRuntime`) with known weights, so
/// the expected words follow from those weights and the window's tokens alone.
final class WordTimingsTranscriberTests: XCTestCase {
    static let heads = [[0, 0], [1, 1]]
    static let k = 8

    /// The fake weight of head h, slot p, encoder frame f: a peak that moves a frame per slot, plus a pattern
    /// that differs from slot to slot and frame to frame (a row or frame cut one off gives other words); the
    /// row predicting eos (slot `eosRow`) holds every frame after its own (the audio after the last word).
    static func weight(_ h: Int, _ p: Int, _ f: Int, eosRow: Int) -> Float {
        if p == eosRow && f > p { return 1 }
        let d = Double(f - p - h)
        return Float(Foundation.exp(-d * d / 6) + 0.01 * Double((7 * p + 3 * f + h) % 5))
    }

    /// Serves every function from `base` but the decoder's align function, which returns `weight` of the call's
    /// slots (position + i) as fp16 (1, heads, K, frames) and records each call's ids and position (its cache mask
    /// must be that of the position). With `eosRow` (the slot of the row predicting eos) and `validFrames`, the
    /// frames after the valid ones weigh 10 for the rows before the last four text tokens and nearly 0 for the
    /// others (uncut, they would pull the last words past the window's end: the host must cut them).
    final class FakeAlignRuntime: ModelRuntime, @unchecked Sendable {
        let base: ModelRuntime
        let manifest: BundleManifest
        let lock = NSLock()
        var calls: [(ids: [Int], position: Int)] = []
        var validFrames: Int?
        var eosRow: Int?
        var name: String { "fake-align over \(base.name)" }

        init(base: ModelRuntime, manifest: BundleManifest) { (self.base, self.manifest) = (base, manifest) }

        func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
            guard let a = manifest.decoder.alignment, functionName == a.function else {
                return try await base.loadModel(at: package, functionName: functionName, computeUnits: computeUnits)
            }
            return FakeAlign(runtime: self, alignment: a, frames: manifest.decoder.memoryShape[2],
                             io: manifest.expectedAlignIO(a))
        }
    }

    final class FakeAlign: RuntimeModel, @unchecked Sendable {
        let runtime: FakeAlignRuntime
        let alignment: BundleManifest.Alignment
        let frames: Int
        let io: ModelIO
        var functionName: String { alignment.function }

        init(runtime: FakeAlignRuntime, alignment: BundleManifest.Alignment, frames: Int, io: ModelIO) {
            (self.runtime, self.alignment, self.frames, self.io) = (runtime, alignment, frames, io)
        }

        func makeState() throws -> RuntimeState { throw TranscriptionError.runtime("the fake align function has no state of its own") }

        func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
            let capacity = runtime.manifest.decoder.capacity
            guard state != nil, let ids = inputs["input_ids"], ids.shape == [1, alignment.length],
                  let position = inputs["position"]?.int32s().first.map(Int.init), let mask = inputs["cache_mask"],
                  mask.data == (try Tensor.cacheMask(filled: position, capacity: capacity)).data else {
                throw TranscriptionError.invalidArgument("fake align: no state, (1, \(alignment.length)) input_ids, position "
                    + "or the cache mask of that position")
            }
            let (valid, eosRow) = runtime.lock.withLock {
                runtime.calls.append((ids.int32s().map(Int.init), position))
                return (runtime.validFrames ?? frames, runtime.eosRow ?? Int.max)
            }
            var bits: [UInt16] = []
            for h in 0..<alignment.heads.count {
                for p in position..<position + alignment.length {
                    for f in 0..<frames {
                        bits.append(floatToFloat16(f < valid ? weight(h, p, f, eosRow: eosRow) : p < eosRow - 4 ? 10 : 1e-4))
                    }
                }
            }
            let data = bits.withUnsafeBufferPointer { Data(buffer: $0) }
            return [BundleManifest.alignOutput: try Tensor(dtype: .float16, shape: [1, alignment.heads.count, alignment.length, frames],
                                                           data: data)]
        }
    }

    /// A `decoder.alignment` block for the test bundle's manifest (its io: what the manifest check expects).
    static func alignmentBlock(_ source: [String: Any], length: Int = k, heads: [[Int]] = heads) throws -> [String: Any] {
        let m = try BundleManifest.decode(try JSONSerialization.data(withJSONObject: source))
        let io = m.expectedAlignIO(BundleManifest.Alignment(function: "align", length: length, heads: heads, leadRows: 1,
                                                             frameSeconds: 0.08))
        return ["function": "align", "length": length, "heads": heads, "lead_rows": 1, "frame_seconds": 0.08,
                "io": try JSONSerialization.jsonObject(with: JSONEncoder().encode(io))]
    }

    /// The test bundle with a `decoder.alignment` block naming the (faked) align function, K = 8 tokens a call (the
    /// released bundles: the extend length, 32), so a window takes several calls; `aligned` false: none, and
    /// the reason in `alignment_note`.
    func alignedBundle(_ aligned: Bool = true) throws -> URL {
        _ = try Fixtures.require()
        let source = Fixtures.bundle
        var json = try JSONSerialization.jsonObject(with: Data(contentsOf: source.appendingPathComponent("manifest.json")))
            as! [String: Any]
        var decoder = json["decoder"] as! [String: Any]
        decoder["alignment"] = aligned ? try Self.alignmentBlock(json) : NSNull()
        decoder["alignment_note"] = aligned ? NSNull() : "exported with --alignment-heads none"
        json["decoder"] = decoder
        let dir = Fixtures.scratch.appendingPathComponent("cohere-swift-aligned-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        for name in try FileManager.default.contentsOfDirectory(atPath: source.path) where name != "manifest.json" {
            try FileManager.default.copyItem(at: source.appendingPathComponent(name), to: dir.appendingPathComponent(name))
        }
        try JSONSerialization.data(withJSONObject: json).write(to: dir.appendingPathComponent("manifest.json"))
        return dir
    }

    /// The first window of the first clip given Python's features (as TranscriberTests reads them).
    func window() throws -> (features: Tensor, valid: Int, language: String, numMelBins: Int) {
        let clip = ((try Fixtures.json("transcripts_python.json") as! [String: Any])["clips"] as! [[String: Any]])[0]
        let w = (clip["windows"] as! [[String: Any]])[0]
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                  shape: [1, m.encoder.numMelBins, w["frames"] as! Int])
        return (features, w["valid_frames"] as! Int, clip["language"] as! String, m.encoder.numMelBins)
    }

    func testWindowWordsComeFromTheAlignRowsOfTheWindowsTokens() async throws {
        let bundle = try alignedBundle()
        let manifest = try BundleManifest.load(bundle: bundle)
        let runtime = FakeAlignRuntime(base: try Fixtures.interpreter(), manifest: manifest)
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let (features, valid, language, _) = try window()
        let prompt = try manifest.prompt(language: language)

        let plain = try await transcriber.transcribeWindow(features: features, validFrames: valid, prompt: prompt)
        XCTAssertNil(plain.words)  // not asked: no align call
        XCTAssertTrue(runtime.calls.isEmpty)

        let start = 40.0
        let frames = manifest.encoder.lengthMasks.encoderLength(validFrames: valid)
        let eos = Set(manifest.tokens.eosTokenIds)
        let text = plain.tokenIds.filter { !eos.contains($0) }
        runtime.validFrames = frames
        runtime.eosRow = prompt.count + text.count - 1
        let w = try await transcriber.transcribeWindow(features: features, validFrames: valid, prompt: prompt,
                                                       startSeconds: start, language: language, wordTimestamps: true)
        let duration = w.durationSeconds  // the valid frames' length
        XCTAssertEqual(w.tokenIds, plain.tokenIds)  // asking for words changes no token
        XCTAssertGreaterThan(text.count, 2)
        // the align calls: from the first row the rule reads (P - 2), K tokens of prompt + text a call, padded with 0
        let ids = prompt + text, rowsFrom = prompt.count - 2
        let starts = Array(stride(from: rowsFrom, to: ids.count, by: Self.k))
        XCTAssertGreaterThan(starts.count, 1)
        XCTAssertEqual(runtime.calls.map(\.position), starts)
        XCTAssertEqual(runtime.calls.map(\.ids), starts.map { s in
            Array(ids[s..<min(s + Self.k, ids.count)]) + [Int](repeating: 0, count: max(0, s + Self.k - ids.count)) })
        XCTAssertEqual(CohereTranscriber.alignStarts(count: 20, rowsFrom: 3, length: 8, capacity: 24), [3, 11, 16])  // the last at C - K

        // the expected words: the rows predicting the prompt's last token, each text token and eos, over the
        // window's valid encoder frames, of the fp16 weights
        XCTAssertLessThan(frames, manifest.decoder.memoryShape[2])  // padded frames exist and must be cut
        let rows = (0..<Self.heads.count).map { h in
            (prompt.count - 2..<prompt.count + text.count).map { p in
                (0..<frames).map { Double(float16ToFloat(floatToFloat16(Self.weight(h, p, $0, eosRow: prompt.count + text.count - 1)))) }
            }
        }
        let vocabulary = await transcriber.detokenizer.pieces
        let pieces = text.map { vocabulary[$0] }
        let words = try XCTUnwrap(w.words)
        let want = try WordAlignment.words(attention: rows, pieces: pieces, probabilities: [Double](repeating: 0.5, count: pieces.count),
                                           frameSeconds: 0.08, offsetSeconds: start, language: language)
            .map { WordTiming(text: $0.text, start: min(max($0.start, start), start + duration),
                              end: min(max($0.end, start), start + duration), probability: 0) }
        XCTAssertEqual(words.map(\.text), want.map(\.text))
        XCTAssertFalse(words.isEmpty)
        for (g, e) in zip(words, want) {
            XCTAssertEqual(g.start, e.start, accuracy: 1e-9, g.text)
            XCTAssertEqual(g.end, e.end, accuracy: 1e-9, g.text)
            XCTAssertTrue(start <= g.start && g.start <= g.end && g.end <= start + duration, "\(g)")
            // each token's probability is that of the greedy choice: at least 1 / vocabulary size, at most 1
            XCTAssertGreaterThanOrEqual(g.probability, 1 / Double(manifest.decoder.vocabSize), g.text)
            XCTAssertLessThanOrEqual(g.probability, 1, g.text)
        }
        XCTAssertGreaterThan(w.timings.alignSeconds, 0)
        XCTAssertLessThan(want.last!.end, start + duration)  // no word needed clamping here

        // a window said to be shorter than its words: each word clamped to it
        let short = want[want.count / 2].start - start
        let cut = try await transcriber.transcribeWindow(features: features, validFrames: valid, prompt: prompt,
                                                         startSeconds: start, durationSeconds: short, language: language,
                                                         wordTimestamps: true)
        let clamped = try XCTUnwrap(cut.words)
        XCTAssertEqual(clamped.map(\.start), want.map { min($0.start, start + short) })
        XCTAssertEqual(clamped.map(\.end), want.map { min($0.end, start + short) })
    }

    /// Whole files: `TranscriptionResult.words` holds every window's words; a bundle without alignment is a
    /// one-line error naming the export option, before any work.
    func testTranscriptionWordsAndTheErrorWithoutAlignment() async throws {
        let bundle = try alignedBundle()
        let manifest = try BundleManifest.load(bundle: bundle)
        guard manifest.files.frontend != nil else { throw XCTSkip("the test bundle has no front-end package") }
        let clip = ((try Fixtures.json("transcripts_package.json") as! [String: Any])["clips"] as! [[String: Any]])[0]
        let wav = URL(fileURLWithPath: clip["wav"] as! String)
        let language = clip["language"] as! String
        let runtime = FakeAlignRuntime(base: try Fixtures.interpreter(), manifest: manifest)
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let r = try await transcriber.transcribe(contentsOf: wav, language: language, wordTimestamps: true, vad: .off)
        let words = try XCTUnwrap(r.words)
        XCTAssertFalse(words.isEmpty)
        XCTAssertEqual(words, r.windows.flatMap { $0.words ?? [] })
        let prompt = try manifest.prompt(language: language)
        XCTAssertEqual(runtime.calls.filter { $0.position == prompt.count - 2 }.count, r.windows.count)  // a pass a window
        XCTAssertTrue(zip(words, words.dropFirst()).allSatisfy { $0.start <= $1.start })
        let without = try await transcriber.transcribe(contentsOf: wav, language: language, vad: .off)
        XCTAssertNil(without.words)

        let plain = try await CohereTranscriber(bundle: try alignedBundle(false), runtime: try Fixtures.interpreter())
        XCTAssertNil(plain.manifest.decoder.alignment)
        do {
            _ = try await plain.transcribe(contentsOf: wav, language: language, wordTimestamps: true)
            XCTFail("word timings from a bundle without alignment")
        } catch {
            XCTAssertTrue("\(error)".contains("(exported with --alignment-heads none)"), "\(error)")
            XCTAssertTrue("\(error)".contains("--alignment-heads auto"), "\(error)")
            XCTAssertFalse("\(error)".contains("\n"))
        }
        XCTAssertThrowsError(try StreamingSession(transcriber: plain, language: language, wordTimestamps: true))
    }

    /// Through the test bundle's own align function, on the interpreter (when its export chose heads: the fixture
    /// words_package.json holds `cohere-coreml transcribe --word-timestamps --json` for the demo clips and a
    /// held-out clip per language): every clip's tokens, words and times as the Python CLI prints them (to the
    /// millisecond); probabilities too, up to the last digit's rounding (Python rounds half to even).
    func testWordsEqualThePythonCLIs() async throws {
        let url = try Fixtures.require().appendingPathComponent("words_package.json")
        guard FileManager.default.fileExists(atPath: url.path) else {
            throw XCTSkip("the test bundle has no alignment (its export chose no heads): no word-timing reference")
        }
        let clips = (try JSONSerialization.jsonObject(with: Data(contentsOf: url)) as! [String: Any])["clips"] as! [[String: Any]]
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        func ms(_ x: Double) -> Double { (x * 1000).rounded() / 1000 }
        var words = 0, windows = 0
        for clip in clips {
            let wav = clip["wav"] as! String
            let r = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: wav), language: clip["language"] as! String,
                                                     wordTimestamps: true, vad: .off)
            XCTAssertEqual(r.windows.map(\.tokenIds), (clip["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] }, wav)
            let want = clip["words"] as! [[String: Any]]
            let got = try XCTUnwrap(r.words)
            XCTAssertEqual(got.map(\.text), want.map { $0["word"] as! String }, wav)
            XCTAssertEqual(got.map { [ms($0.start), ms($0.end)] },
                           want.map { [($0["start"] as! NSNumber).doubleValue, ($0["end"] as! NSNumber).doubleValue] }, wav)
            for (g, w) in zip(got, want) {
                XCTAssertEqual(ms(g.probability), (w["probability"] as! NSNumber).doubleValue, accuracy: 0.001 + 1e-9, "\(wav): \(g.text)")
            }
            words += got.count
            windows += r.windows.count
        }
        XCTAssertGreaterThan(words, 20)
        XCTAssertGreaterThan(windows, clips.count)  // a long clip's windows: words offset by each window's start
        print("WordTimingsTranscriberTests: \(clips.count) clips, \(windows) windows, \(words) words as the Python CLI's")
    }

    /// A stream's finals carry their segment's words, on the stream's timeline and inside the segment, the same
    /// updates as without words otherwise; partials carry none.
    func testStreamFinalsCarryTheirSegmentsWords() async throws {
        let ref = try StreamingTests.reference()
        let audio = try AudioInput.load(contentsOf: URL(fileURLWithPath: ref.wav), sampleRate: 16000)
        let bundle = try alignedBundle()
        let runtime = FakeAlignRuntime(base: try Fixtures.interpreter(), manifest: try BundleManifest.load(bundle: bundle))
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let session = try StreamingSession(transcriber: transcriber, language: ref.language, punctuation: ref.punctuation,
                                           wordTimestamps: true, vad: .off)
        var got: [StreamUpdate] = []
        for chunk in StreamFileSource.chunks(of: audio.samples, sampleRate: 16000) { got += try await session.feed(Array(chunk)) }
        got += try await session.finish()
        XCTAssertEqual(got.map { u -> StreamUpdate in var u = u; u.words = nil; return u }, ref.updates)
        let finals = got.filter { $0.type == .final }
        XCTAssertGreaterThanOrEqual(finals.count, 2)
        let prompt = try transcriber.manifest.prompt(language: ref.language, punctuation: ref.punctuation)
        // one align pass per final (its first call at the first row the rule reads), none for partials
        XCTAssertEqual(runtime.calls.filter { $0.position == prompt.count - 2 }.count, finals.count)
        XCTAssertTrue(got.filter { $0.type == .partial }.allSatisfy { $0.words == nil })
        for f in finals {
            let words = try XCTUnwrap(f.words)
            XCTAssertFalse(words.isEmpty)
            XCTAssertTrue(words.allSatisfy { f.start <= $0.start && $0.start <= $0.end && $0.end <= f.end }, "\(f)")
        }
        XCTAssertGreaterThan(finals[1].words![0].start, finals[0].end - 1e-9)  // the second segment's own offset
    }

    /// The manifest's block: checked as the Python loader checks it (`_check_alignment`: the refusal names the
    /// field); null with the reason in `alignment_note`, which word timings then say in one line.
    func testTheAlignmentBlockIsChecked() throws {
        let source = try JSONSerialization.jsonObject(with: Data(contentsOf: try Fixtures.require()
            .appendingPathComponent("bundle/manifest.json"))) as! [String: Any]
        func manifest(_ alignment: Any?, note: Any? = nil) throws -> BundleManifest {
            var json = source
            var decoder = json["decoder"] as! [String: Any]
            decoder["alignment"] = alignment ?? NSNull()
            decoder["alignment_note"] = note ?? NSNull()
            json["decoder"] = decoder
            return try BundleManifest.decode(try JSONSerialization.data(withJSONObject: json))
        }
        let capacity = (source["decoder"] as! [String: Any])["capacity"] as! Int
        var good = try Self.alignmentBlock(source, length: 4, heads: [[1, 0]])
        good["calibration"] = ["set": "x", "clips": 2, "words": 9, "median_s": 0.05, "p90_s": 0.2, "baseline_median_s": 0.3]
        let a = try manifest(good).checkedAlignment(promptLength: 10)
        XCTAssertEqual(a.heads, [[1, 0]])
        XCTAssertEqual([a.length, a.leadRows], [4, 1])
        XCTAssertEqual(a.frameSeconds, 0.08)
        XCTAssertEqual(a, try manifest(good).decoder.alignment)
        // refused by the manifest check, naming Python's field
        let refused: [(Any?, Any?, String)] = [
            (nil, nil, "decoder.alignment_note"),
            (good, "a reason", "decoder.alignment_note"),
            (7, nil, "decoder.alignment"),
            (good.merging(["function": "main"]) { $1 }, nil, "decoder.alignment.function"),
            (good.merging(["length": capacity + 1]) { $1 }, nil, "decoder.alignment.length"),
            (good.merging(["heads": [[1]]]) { $1 }, nil, "decoder.alignment.heads[0]"),
            (good.merging(["heads": [[1, 0], [0, 99]]]) { $1 }, nil, "decoder.alignment.heads[1]"),
            (good.merging(["heads": [["1", 0]]]) { $1 }, nil, "decoder.alignment.heads[0]"),
            (good.merging(["heads": [] as [Any]]) { $1 }, nil, "decoder.alignment.heads"),
            (good.merging(["lead_rows": capacity]) { $1 }, nil, "decoder.alignment.lead_rows"),
            (good.merging(["frame_seconds": 0]) { $1 }, nil, "decoder.alignment.frame_seconds"),
            (good.filter { $0.key != "io" }, nil, "decoder.alignment.io"),
            (good.merging(["length": 5]) { $1 }, nil, "decoder.alignment.io.inputs.input_ids.shape"),
            (good.merging(["calibration": ["set": "x"]]) { $1 }, nil, "decoder.alignment.calibration.clips"),
        ]
        for (block, note, field) in refused {
            XCTAssertThrowsError(try manifest(block, note: note), field) {
                XCTAssertEqual(($0 as? BundleError)?.field, field, "\($0)")
            }
        }
        // accepted, then said when word timings are asked
        let none = try manifest(nil, note: "exported with --alignment-heads none")
        XCTAssertNil(none.decoder.alignment)
        XCTAssertEqual(none.decoder.alignmentNote, "exported with --alignment-heads none")
        XCTAssertThrowsError(try none.checkedAlignment(promptLength: 10)) {
            XCTAssertTrue("\($0)".contains("no word alignment (exported with --alignment-heads none)"), "\($0)")
            XCTAssertTrue("\($0)".contains("--alignment-heads auto"), "\($0)")
            XCTAssertFalse("\($0)".contains("\n"))
        }
        XCTAssertThrowsError(try manifest(good.merging(["lead_rows": 10]) { $1 }).checkedAlignment(promptLength: 10)) {
            XCTAssertTrue("\($0)".contains("decoder.alignment.lead_rows"), "\($0)")  // no row before the prompt
        }
    }

    /// A final's JSON line carries its words after the token ids; without words the line is as before.
    func testStreamFinalsJSONLineWithWords() throws {
        var u = StreamUpdate(type: .final, segment: 0, audioTime: 2, start: 0.5, end: 2, text: "hi", tokenIds: [5],
                             confirmedTokenIds: [5])
        XCTAssertFalse(u.jsonLine().contains("words"))
        u.words = [WordTiming(text: "hi \"x\"", start: 0.54, end: 1.2504, probability: 0.49961)]
        let object = try JSONSerialization.jsonObject(with: Data(u.jsonLine().utf8)) as! [String: Any]
        let words = object["words"] as! [[String: Any]]
        XCTAssertEqual(words[0]["word"] as? String, "hi \"x\"")
        XCTAssertEqual(words[0]["start"] as? Double, 0.54)
        XCTAssertEqual(words[0]["end"] as? Double, 1.25)  // to the millisecond, as Python prints it
        XCTAssertEqual(words[0]["probability"] as? Double, 0.5)
        XCTAssertTrue(u.jsonLine().hasSuffix(#""confirmed_token_ids": [5], "words": [{"word": "hi \"x\"", "start": 0.54, "end": 1.25, "probability": 0.5}]}"#))
        XCTAssertEqual(try JSONDecoder().decode(StreamUpdate.self, from: JSONEncoder().encode(u)), u)
    }
}

/// docs/swift.md's word-timings snippet, verbatim: compiled with the tests (not run: it needs a bundle), so the
/// page cannot show an API the package does not have.
func wordTimingsSnippet(transcriber: CohereTranscriber, audioURL: URL) async throws {
    let result = try await transcriber.transcribe(contentsOf: audioURL, language: "en", wordTimestamps: true)
    for word in result.words ?? [] {
        print(String(format: "%.2f-%.2f", word.start, word.end), word.text, word.probability)
    }
}
