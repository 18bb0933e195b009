@testable import CohereTranscribe
import Foundation
import XCTest

/// The stream's segments with the VAD on (`VADSegmenter`, Python's `VadSegmenter`): the stream rule's events
/// (`StreamVAD`, checked against silero-vad's VADIterator by the shared vectors) acting at the first frame
/// boundary at or after the chunk that decided them; the maximum and cut; the end of the audio; and through a
/// session on the test bundle with a faked VAD package, the same updates however the audio is chunked.
final class VADSegmenterTests: XCTestCase {
    static let frame = 160

    static func segmenter(maxSegment: Int = 560_000, options: VADOptions = VADOptions()) throws -> VADSegmenter {
        try VADSegmenter(options: options, frameSamples: frame, sampleRate: 16000, maxSegment: maxSegment,
                         overlapSeconds: 5, minEnergyWindow: 1600)
    }

    /// Runs `probabilities` (one a chunk) through a segmenter frame by frame (all chunks added first, as a feed
    /// of the whole audio does), over `audio`; the events and the frame each came at.
    static func run(_ probabilities: [Float], audio: [Float]? = nil, segmenter: inout VADSegmenter) throws -> [SegmentEvent] {
        let x = audio ?? [Float](repeating: 0, count: probabilities.count * 512)
        segmenter.add(probabilities: probabilities)
        var events: [SegmentEvent] = []
        for _ in 0..<(x.count / frame) {
            if let e = try segmenter.push(0, audio: { Array(x[$0..<$1]) }) { events.append(e) }
        }
        return events
    }

    /// The rule's events with the sample at which each was decided (its chunk's end).
    static func ruleEvents(_ probabilities: [Float], options: VADOptions = VADOptions()) -> [(decided: Int, event: StreamVAD.Event)] {
        var rule = StreamVAD(options: options)
        return probabilities.enumerated().compactMap { i, p in rule.push(p).map { ((i + 1) * 512, $0) } }
    }

    /// The first frame boundary at or after `sample`.
    static func boundary(_ sample: Int) -> Int { (sample + frame - 1) / frame * frame }

    func testSegmentsOpenAndCloseAtTheRulesEventsOnTheNextFrameBoundary() throws {
        // silence, speech, a pause longer than min_silence_ms, speech, silence
        let p: [Float] = [Float](repeating: 0.05, count: 10) + [Float](repeating: 0.9, count: 40)
            + [Float](repeating: 0.05, count: 20) + [Float](repeating: 0.8, count: 15) + [Float](repeating: 0.1, count: 12)
        var s = try Self.segmenter()
        let events = try Self.run(p, segmenter: &s)
        let rule = Self.ruleEvents(p)
        XCTAssertEqual(rule.count, 4)
        XCTAssertEqual(events.map(\.kind), [.open, .close, .open, .close])
        for (e, r) in zip(events, rule) {
            XCTAssertEqual(e.frameEnd, Self.boundary(r.decided))
            switch r.event {
            case .start(let sample): XCTAssertEqual(e.start, sample)
            case .end(let sample): XCTAssertEqual(e.end, sample)
            }
        }
        XCTAssertEqual(events[2].start, max(events[1].end!, events[2].start))  // never before the previous end
        XCTAssertNil(s.start)
        XCTAssertEqual(s.previousEnd, events[3].end)
        // the window the session keeps while none is open reaches back to any start the rule can give
        XCTAssertEqual(s.preroll, 512 + 480 + Self.frame)
    }

    /// A segment that reaches the maximum is cut at the quietest window before it (the energy segmenter's cut)
    /// and stays open; the end closes the rest.
    func testALongSegmentIsCutAndStaysOpen() throws {
        let p: [Float] = [Float](repeating: 0.05, count: 4) + [Float](repeating: 0.9, count: 40)
            + [Float](repeating: 0.05, count: 10)
        var g = SplitMix64(seed: 9)
        var audio = (0..<(p.count * 512)).map { _ in Float(Int(g.next() % 2001) - 1000) * 1e-4 }
        for i in 14_000..<14_400 { audio[i] = 0 }  // the quietest stretch inside the cut's search range
        var s = try Self.segmenter(maxSegment: 16_000)
        let events = try Self.run(p, audio: audio, segmenter: &s)
        XCTAssertEqual(events.map(\.kind), [.open, .cut, .close])
        let (open, cut) = (events[0], events[1])
        XCTAssertEqual(cut.frameEnd, Self.boundary(open.start + 16_000))
        XCTAssertEqual(cut.start, open.start)
        let want = Segmenter.cutPoint(start: open.start, maxSegment: 16_000, context: 80_000, minEnergyWindow: 1600,
                                          frame: Self.frame) { Array(audio[$0..<$1]) }
        XCTAssertEqual(cut.end, want)
        XCTAssertTrue((14_000 - 1600)...14_400 ~= want, "\(want)")
        XCTAssertEqual(events[2].start, want)  // the rest continues from the cut
    }

    /// At the end of the audio an open segment closes at a pending end's sample, else at the last sample; a
    /// start decided after the last whole frame is not opened.
    func testTheEndOfTheAudioClosesTheOpenSegment() throws {
        let speech: [Float] = [Float](repeating: 0.05, count: 3) + [Float](repeating: 0.9, count: 20)
        var s = try Self.segmenter()
        _ = try Self.run(speech, segmenter: &s)
        let open = try XCTUnwrap(s.start)
        let total = speech.count * 512 + 100
        XCTAssertEqual(s.finish(total: total), SegmentEvent(kind: .close, frameEnd: total, start: open, end: total))
        XCTAssertNil(s.start)
        // an end decided inside the last, partial frame: closed at its sample
        var t = try Self.segmenter()
        let p = speech + [Float](repeating: 0.05, count: 5)
        t.add(probabilities: p)
        for _ in 0..<((p.count * 512 - 1) / Self.frame) { _ = try t.push(0) { _, _ in [] } }  // stop short of the end's frame
        guard case .end(let sample)? = Self.ruleEvents(p).last?.event else { return XCTFail("no end") }
        XCTAssertEqual(t.finish(total: p.count * 512)?.end, sample)
        // nothing open: nothing to close
        var u = try Self.segmenter()
        XCTAssertNil(u.finish(total: 1000))
    }

    /// Through a session on the test bundle (faked VAD): the finals are the segmenter's segments, the same
    /// whatever the chunk sizes, only the VAD's chunk function is called (one chunk a call), and `.off` is the
    /// energy segmenter with no VAD call.
    func testSessionSegmentsDoNotDependOnTheChunking() async throws {
        let bundle = try VADTranscriberTests.vadBundle()
        let manifest = try BundleManifest.load(bundle: bundle)
        let runtime = VADTranscriberTests.FakeVADRuntime(base: try Fixtures.interpreter(), manifest: manifest)
        let transcriber = try await CohereTranscriber(bundle: bundle, runtime: runtime)
        let (samples, _) = try VADTranscriberTests.sparseAudio()
        func updates(chunk: Int, vad: VADMode) async throws -> [StreamUpdate] {
            let session = try StreamingSession(transcriber: transcriber, language: "en", vad: vad)
            XCTAssertEqual(session.usesVAD, vad != .off)
            var out: [StreamUpdate] = []
            for at in stride(from: 0, to: samples.count, by: chunk) {
                out += try await session.feed(Array(samples[at..<min(at + chunk, samples.count)]))
            }
            return out + (try await session.finish())
        }
        let a = try await updates(chunk: 1600, vad: .auto)
        let calls = runtime.lock.withLock { runtime.calls }
        XCTAssertEqual(calls.count, samples.count / 512)
        XCTAssertTrue(calls.allSatisfy { $0.function == "chunk" && $0.rows == 1 })
        let b = try await updates(chunk: 777, vad: .on)
        XCTAssertEqual(a.filter { $0.type == .final }, b.filter { $0.type == .final })
        // the finals: the segments of a segmenter fed the same probabilities
        let frames = VoiceActivity.frames(samples[...], before: [], chunk: 512, context: 64)
        let probabilities = (0..<(samples.count / 512)).map { VADTranscriberTests.probability(frames[($0 * 576)..<(($0 + 1) * 576)]) }
        var s = try Self.segmenter()
        let events = try Self.run(probabilities, audio: samples, segmenter: &s)
        var closes = events.filter { $0.kind == .close }
        if let last = s.finish(total: samples.count) { closes.append(last) }
        let finals = a.filter { $0.type == .final }
        XCTAssertGreaterThanOrEqual(finals.count, 2)
        XCTAssertEqual(finals.map { Int(($0.start * 16000).rounded()) }, closes.map(\.start))
        XCTAssertEqual(finals.map { Int(($0.end * 16000).rounded()) }, closes.map { $0.end! })
        let before = runtime.lock.withLock { runtime.calls.count }
        let energy = try await updates(chunk: 1600, vad: .off)
        XCTAssertEqual(runtime.lock.withLock { runtime.calls.count }, before)
        XCTAssertNotEqual(energy.filter { $0.type == .final }.map(\.start), finals.map(\.start))
    }
}
