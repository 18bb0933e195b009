@testable import CohereTranscribe
import Foundation
import XCTest

/// Live transcription: the Swift session gives Python's updates (streaming.json, written by
/// tools/cohere_coreml_dev/swift_fixtures.py from `cohere-coreml transcribe --stream --no-pace --json`),
/// and unit tests of the segmenter and LocalAgreement with the broken variants they reject.
final class StreamingTests: XCTestCase {
    struct Reference: Decodable {
        var wav: String
        var samples: Int
        var language: String
        var punctuation: Bool
        var chunkSamples: Int
        var updates: [StreamUpdate]
        var lines: [String]
        /// Python's `--stats` line for the same chunks (with the bundle's extend function) and without extend.
        var stats: StreamStats
        var statsWithoutExtend: StreamStats
        enum CodingKeys: String, CodingKey {
            case wav, samples, language, punctuation, updates, lines, stats
            case chunkSamples = "chunk_samples"
            case statsWithoutExtend = "stats_without_extend"
        }
    }

    static func reference() throws -> Reference {
        let dir = try Fixtures.require()
        return try JSONDecoder().decode(Reference.self, from: Data(contentsOf: dir.appendingPathComponent("streaming.json")))
    }

    static func transcriber() async throws -> CohereTranscriber {
        try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
    }

    /// Every field of every update as Python's (times exactly: both divide the same integer sample counts
    /// by 16000 in IEEE double), line for line as JSON too.
    func assertSame(_ got: [StreamUpdate], _ want: [StreamUpdate], _ what: String) {
        XCTAssertEqual(got.count, want.count, "\(what): number of updates")
        for (i, (g, w)) in zip(got, want).enumerated() {
            XCTAssertEqual(g, w, "\(what): update \(i)")
        }
    }

    func testSessionGivesPythonsUpdatesForTheSameChunks() async throws {
        let ref = try Self.reference()
        let audio = try AudioInput.load(contentsOf: URL(fileURLWithPath: ref.wav), sampleRate: 16000)
        XCTAssertEqual(audio.samples.count, ref.samples)
        // the comparison has teeth: partials whose confirmed prefix is shorter than the hypothesis, finals
        let partials = ref.updates.filter { $0.type == .partial }
        XCTAssertTrue(partials.contains { $0.confirmedTokenIds.count < $0.tokenIds.count && !$0.confirmedTokenIds.isEmpty })
        XCTAssertGreaterThanOrEqual(ref.updates.filter { $0.type == .final }.count, 2)

        let t = try await Self.transcriber()
        let session = try StreamingSession(transcriber: t, language: ref.language, punctuation: ref.punctuation, vad: .off)
        var got: [StreamUpdate] = []
        for chunk in StreamFileSource.chunks(of: audio.samples, sampleRate: 16000) {
            XCTAssertLessThanOrEqual(chunk.count, ref.chunkSamples)
            got += try await session.feed(Array(chunk))
        }
        got += try await session.finish()
        assertSame(got, ref.updates, "0.1 s chunks")
        XCTAssertEqual(got.map { $0.jsonLine() }, ref.lines, "JSON lines as Python prints them")
        let stats = session.stats
        XCTAssertEqual(stats.finals, ref.updates.filter { $0.type == .final }.count)
        XCTAssertEqual(stats.partials, partials.count)
        XCTAssertEqual(stats.encoderCalls, stats.partials + stats.finals)  // one encoder call per update
        XCTAssertEqual(stats.audioSeconds, Double(ref.samples) / 16000)
        // Python's compute counters, every one (the confirmed prefix fed by the same extend calls)
        XCTAssertEqual(stats, ref.stats, "the counters of Python's --stats line")
        XCTAssertGreaterThan(stats.decoderTokens, stats.decoderCalls)  // extend calls feed K slots

        // every final is the offline transcription of its segment's samples
        for f in got where f.type == .final {
            let piece = Array(audio.samples[Int((f.start * 16000).rounded())..<Int((f.end * 16000).rounded())])
            let offline = try await t.transcribe(samples: piece, language: ref.language, vad: .off)
            XCTAssertEqual(offline.windows.count, 1)
            XCTAssertEqual(offline.windows[0].tokenIds.filter { !t.manifest.tokens.eosTokenIds.contains($0) }, f.tokenIds)
            XCTAssertEqual(offline.text, f.text)
        }
    }

    /// The counter comparison has teeth: a transcriber that does not use extend (the fallback: forced prefixes
    /// fed by steps) gives the same finals but other counters, Python's --no-extend ones; and `feedPlan` plans
    /// what Python's `feed_plan` plans.
    func testCountersWithoutExtendDifferAndEqualPythonsFallback() async throws {
        let ref = try Self.reference()
        XCTAssertNotEqual(ref.stats.decoderCalls, ref.statsWithoutExtend.decoderCalls)
        let audio = try AudioInput.load(contentsOf: URL(fileURLWithPath: ref.wav), sampleRate: 16000)
        let t = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter(), useExtend: false)
        let session = try StreamingSession(transcriber: t, language: ref.language, punctuation: ref.punctuation, vad: .off)
        var got: [StreamUpdate] = []
        for chunk in StreamFileSource.chunks(of: audio.samples, sampleRate: 16000) { got += try await session.feed(Array(chunk)) }
        got += try await session.finish()
        XCTAssertEqual(got.filter { $0.type == .final }, ref.updates.filter { $0.type == .final })
        XCTAssertNotEqual(session.stats, ref.stats)
        XCTAssertEqual(session.stats, ref.statsWithoutExtend)
        let line = try JSONSerialization.jsonObject(with: Data(ref.stats.jsonLine().utf8)) as? [String: Any]
        XCTAssertEqual(line?["decoder_tokens"] as? Int, ref.stats.decoderTokens)
        XCTAssertEqual((line?["per_audio_second"] as? [String: Any])?.count, 5)
    }

    func testFeedPlanIsPythons() {
        XCTAssertEqual(feedPlan(count: 10, start: 0, capacity: 64, prefillLength: 10, extendLength: 32),
                       [FeedCall(function: .prefill, offset: 0, count: 10, fed: 10)])
        XCTAssertEqual(feedPlan(count: 33, start: 0, capacity: 64, prefillLength: 10, extendLength: 32),
                       [FeedCall(function: .extend, offset: 0, count: 32, fed: 32), FeedCall(function: .step, offset: 32, count: 1, fed: 1)])
        XCTAssertEqual(feedPlan(count: 34, start: 0, capacity: 64, prefillLength: 10, extendLength: 32),
                       [FeedCall(function: .extend, offset: 0, count: 32, fed: 32), FeedCall(function: .extend, offset: 32, count: 2, fed: 32)])
        XCTAssertEqual(feedPlan(count: 40, start: 0, capacity: 48, prefillLength: 10, extendLength: 32),
                       [FeedCall(function: .extend, offset: 0, count: 32, fed: 32)]
                           + (32..<40).map { FeedCall(function: .step, offset: $0, count: 1, fed: 1) })
        XCTAssertEqual(feedPlan(count: 12, start: 0, capacity: 64, prefillLength: 10, extendLength: nil),
                       (0..<12).map { FeedCall(function: .step, offset: $0, count: 1, fed: 1) })
        XCTAssertEqual(feedPlan(count: 10, start: 5, capacity: 64, prefillLength: 10, extendLength: 32),
                       [FeedCall(function: .extend, offset: 0, count: 10, fed: 32)])
        // a prompt of 8 and a draft of 2: the rows after token 7 are read, which a prefill call does not return
        XCTAssertEqual(feedPlan(count: 10, start: 0, capacity: 64, prefillLength: 10, extendLength: 32, rowsFrom: 7),
                       [FeedCall(function: .extend, offset: 0, count: 10, fed: 32)])
        XCTAssertEqual(feedPlan(count: 10, start: 0, capacity: 64, prefillLength: 10, extendLength: 32, rowsFrom: 9),
                       [FeedCall(function: .prefill, offset: 0, count: 10, fed: 10)])
    }

    /// The async API (input continuation + update stream) with another chunking: the same updates
    /// (decisions are taken at frame boundaries, whatever the chunks).
    func testAsyncStreamWithOtherChunksGivesTheSameUpdates() async throws {
        let ref = try Self.reference()
        let audio = try AudioInput.load(contentsOf: URL(fileURLWithPath: ref.wav), sampleRate: 16000)
        let t = try await Self.transcriber()
        let (input, updates) = try t.stream(language: ref.language, punctuation: ref.punctuation, vad: .off)
        let samples = audio.samples
        let feeder = Task {
            for start in stride(from: 0, to: samples.count, by: 7777) {
                input.yield(Array(samples[start..<min(start + 7777, samples.count)]))
            }
            input.finish()
        }
        var got: [StreamUpdate] = []
        for try await update in updates { got.append(update) }
        await feeder.value
        assertSame(got, ref.updates, "7777-sample chunks through stream(language:)")
    }

    func testStreamRefusesBadInputByName() async throws {
        _ = try Self.reference()
        let t = try await Self.transcriber()
        XCTAssertThrowsError(try t.stream(language: "xx")) { XCTAssertTrue("\($0)".contains("xx"), "\($0)") }
        XCTAssertThrowsError(try t.stream(language: "en", config: StreamConfig(agreement: 0))) {
            XCTAssertTrue("\($0)".contains("agreement"), "\($0)")
        }
        let session = try StreamingSession(transcriber: t, language: "en")
        do {
            _ = try await session.feed([0, .nan, 0])
            XCTFail("a NaN sample was accepted")
        } catch {
            XCTAssertTrue("\(error)".contains("NaN"), "\(error)")
        }
        _ = try await session.finish()
        do {
            _ = try await session.feed([0])
            XCTFail("a finished session accepted samples")
        } catch {
            XCTAssertTrue("\(error)".contains("finished"), "\(error)")
        }
    }

    func testUpdateJSONKeysArePythons() throws {
        let u = StreamUpdate(type: .partial, segment: 1, audioTime: 1.41, start: 0.9, end: 1.41, text: "a \"b\" / ü",
                             tokenIds: [5, 6], confirmedTokenIds: [5])
        let object = try JSONSerialization.jsonObject(with: JSONEncoder().encode(u)) as? [String: Any]
        XCTAssertEqual(Set(object?.keys.map { $0 } ?? []),
                       ["type", "segment", "audio_time", "start", "end", "text", "token_ids", "confirmed_token_ids"])
        XCTAssertEqual(try JSONDecoder().decode(StreamUpdate.self, from: Data(u.jsonLine().utf8)), u)
        XCTAssertEqual(u.jsonLine(), #"{"type": "partial", "segment": 1, "audio_time": 1.41, "start": 0.9, "end": 1.41, "#
            + #""text": "a \"b\" / ü", "token_ids": [5, 6], "confirmed_token_ids": [5]}"#)
        // Python: json.dumps("\t\u0001\\ é", ensure_ascii=False)
        XCTAssertEqual(JSONValue.quoted("\t\u{01}\\ é"), #""\t\u0001\\ é""#)
    }

    // MARK: - segmenter

    /// Noise at -60 dBFS with three "words" of tone (the middle one with a 150 ms gap inside, as a stop
    /// consonant would leave) separated by 700 ms pauses; 16 kHz, 10 ms frames.
    static func words(gain: Float = 1) -> (samples: [Float], words: [(Int, Int)]) {
        var rng = SplitMix64(seed: 1)
        var x: [Float] = []
        var words: [(Int, Int)] = []
        func noise(_ seconds: Double) {
            for _ in 0..<Int(seconds * 16000) { x.append(gain * 0.001 * (Float(rng.next() % 2001) / 1000 - 1)) }
        }
        func tone(_ seconds: Double) {
            for i in 0..<Int(seconds * 16000) {
                x.append(gain * (0.1 * sin(2 * .pi * 220 * Float(i) / 16000) + 0.001 * (Float(rng.next() % 2001) / 1000 - 1)))
            }
        }
        noise(1.0)
        for w in 0..<3 {
            let start = x.count
            if w == 1 {
                tone(0.4); noise(0.15); tone(0.4)
            } else {
                tone(0.6)
            }
            words.append((start, x.count))
            noise(0.7)
        }
        noise(0.5)
        return (x, words)
    }

    static func segments(_ x: [Float], config: StreamConfig, maxSegment: Int = 35 * 16000,
                         overlapSeconds: Double = 5) throws -> [SegmentEvent] {
        var s = try Segmenter(config: config, frameSamples: 160, sampleRate: 16000, maxSegment: maxSegment,
                              overlapSeconds: overlapSeconds, minEnergyWindow: 1600)
        var events: [SegmentEvent] = []
        for k in 0..<x.count / 160 {
            if let e = s.push(framePower(x[k * 160..<(k + 1) * 160]), audio: { Array(x[$0..<$1]) }), e.kind != .open {
                events.append(e)
            }
        }
        if let e = s.finish(total: x.count) { events.append(e) }
        return events
    }

    func testSegmenterGivesOneSegmentPerWordAndHangoverKeepsWordsWhole() throws {
        let (x, words) = Self.words()
        let segments = try Self.segments(x, config: StreamConfig())
        XCTAssertEqual(segments.count, words.count, "\(segments)")
        for (seg, word) in zip(segments, words) {
            XCTAssertEqual(seg.kind, .close)
            XCTAssertEqual(seg.start, word.0 / 160 * 160 - 1600, "pre-roll: 10 frames before the first speech frame")
            let end = try XCTUnwrap(seg.end)
            XCTAssertGreaterThanOrEqual(end, word.1 + 30 * 160 - 160)  // the hangover after the word
            XCTAssertLessThanOrEqual(end, word.1 + 31 * 160)
        }
        // relative thresholds: 26 dB louder, the same segments
        XCTAssertEqual(try Self.segments(Self.words(gain: 20).samples, config: StreamConfig()), segments)
        // broken variant: a one-frame hangover splits the word with the gap
        let short = try Self.segments(x, config: StreamConfig(hangoverSeconds: 0.01))
        XCTAssertEqual(short.count, words.count + 1, "\(short)")
    }

    func testSegmenterCutsWhereSplitPointsCuts() throws {
        // 3 s of tone with quieter stretches: a 1 s segment limit cuts like AudioSplitter at 1 s pieces
        var x: [Float] = []
        for i in 0..<(3 * 16000) {
            let quiet = (i / 1600) % 7 == 3 || (i / 1600) % 11 == 8
            x.append((quiet ? 0.02 : 0.1) * sin(2 * .pi * 220 * Float(i) / 16000))
        }
        x = [Float](repeating: 0.0005, count: 16000) + x
        let events = try Self.segments(x, config: StreamConfig(), maxSegment: 16000, overlapSeconds: 0.5)
        let cuts = events.filter { $0.kind == .cut }
        XCTAssertGreaterThanOrEqual(cuts.count, 2, "\(events)")
        for cut in cuts {
            let piece = Array(x[cut.start...])
            let split = AudioSplitter.splitPoints(sampleCount: piece.count, samples: piece, sampleRate: 16000,
                                                  maxClipSeconds: 1, overlapSeconds: 0.5, minEnergyWindow: 1600)
            XCTAssertEqual(cut.end, cut.start + split[0].upperBound, "\(cut)")
            XCTAssertEqual(cut.frameEnd, cut.start + 16000)
        }
        for (a, b) in zip(events, events.dropFirst()) { XCTAssertEqual(a.end, b.start) }  // cut pieces abut
    }

    func testFramePowerSumsInSampleOrder() {
        // 1 then 159 squares of 9e-18: in sample order each is lost against 1.0 (below half an ulp), a pairwise
        // sum (numpy's mean: the broken variant) adds them up first and lands ~6 ulps above 1.0
        let frame: [Float] = [1] + [Float](repeating: 3e-9, count: 159)
        func pairwise(_ v: ArraySlice<Double>) -> Double {
            v.count <= 2 ? v.reduce(0, +) : pairwise(v.prefix(v.count / 2)) + pairwise(v.suffix(v.count - v.count / 2))
        }
        let squares = frame.map { Double($0) * Double($0) }
        XCTAssertEqual(framePower(frame[...]), 1.0 / 160 + 1e-10)
        XCTAssertNotEqual(pairwise(squares[...]) / 160 + 1e-10, framePower(frame[...]))
        XCTAssertEqual(framesOf(0.3, frameSamples: 160, sampleRate: 16000), 30)
        XCTAssertEqual(framesOf(0.025, frameSamples: 160, sampleRate: 16000), 2, "ties to even: 2.5 -> 2")
        XCTAssertEqual(framesOf(0.001, frameSamples: 160, sampleRate: 16000), 1, "at least one frame")
    }

    // MARK: - LocalAgreement

    func testLocalAgreement() throws {
        let hyps = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]
        XCTAssertEqual(try LocalAgreement.confirm(Array(hyps.prefix(1)), n: 2), [], "fewer than n: unchanged")
        XCTAssertEqual(try LocalAgreement.confirm(Array(hyps.prefix(2)), n: 2), [1, 2, 3])
        XCTAssertEqual(try LocalAgreement.confirm(hyps, n: 3), [1, 2])
        // broken variant n = 1 confirms the whole last hypothesis, which n = 2 does not
        XCTAssertEqual(try LocalAgreement.confirm(Array(hyps.prefix(2)), n: 1), [1, 2, 3, 5, 6])
        XCTAssertNotEqual(try LocalAgreement.confirm(Array(hyps.prefix(2)), n: 1),
                          try LocalAgreement.confirm(Array(hyps.prefix(2)), n: 2))
        XCTAssertThrowsError(try LocalAgreement.confirm(hyps, n: 2, confirmed: [1, 2, 3]))  // [1,2,7] drops a confirmed token
        XCTAssertThrowsError(try LocalAgreement.confirm(hyps, n: 0))
        XCTAssertEqual(LocalAgreement.commonPrefix([]), [])
        XCTAssertEqual(LocalAgreement.commonPrefix([[1, 2], [1, 2, 3]]), [1, 2])
    }
}
