@testable import CohereTranscribe
import Foundation
import XCTest

/// The speech-region rule (VoiceActivity/SpeechRegions.swift) against the shared test vectors
/// (tests/data/vad_vectors.json, written by tools/data/make_vad_vectors.py from silero-vad's own functions),
/// read from the repository as the word-timing vectors are. Every case must match exactly: the answers are
/// integers (samples, chunk indices).
final class SpeechRegionsTests: XCTestCase {
    static let vectors = Fixtures.repoRoot.appendingPathComponent("tests/data/vad_vectors.json")

    static let document: [String: Any] = {
        guard let data = try? Data(contentsOf: vectors),
              let doc = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else { return [:] }
        return doc
    }()

    func cases(_ key: String) throws -> [[String: Any]] {
        guard let all = Self.document[key] as? [[String: Any]] else {
            XCTFail("\(Self.vectors.path) has no '\(key)' cases (tools/data/make_vad_vectors.py writes them)")
            return []
        }
        return all
    }

    /// A case's options as Python's `VadOptions.from_dict` reads them (missing keys: the defaults).
    static func options(_ value: Any?) throws -> VADOptions {
        let object = value as? [String: Any] ?? [:]
        return try JSONDecoder().decode(VADOptions.self, from: JSONSerialization.data(withJSONObject: object))
    }

    static func spans(_ value: Any?) -> [SampleSpan] {
        (value as? [[NSNumber]] ?? []).map { SampleSpan(start: $0[0].intValue, end: $0[1].intValue) }
    }

    static func probabilities(_ c: [String: Any]) -> [Double] { (c["probs"] as! [NSNumber]).map(\.doubleValue) }

    /// Every region case: the regions silero-vad's get_speech_timestamps_from_probs gave, sample for sample.
    func testEveryRegionCaseMatchesSileroVAD() throws {
        let all = try cases("regions")
        XCTAssertGreaterThanOrEqual(all.count, 10)
        var regions = 0
        for c in all {
            let name = c["name"] as? String ?? "?"
            let got = speechRegions(Self.probabilities(c), sampleCount: (c["n_samples"] as! NSNumber).intValue,
                                    options: try Self.options(c["options"]),
                                    maxSpeechSeconds: (c["max_speech_s"] as? NSNumber)?.doubleValue)
            XCTAssertEqual(got, Self.spans(c["expected"]), name)
            regions += got.count
        }
        print("SpeechRegionsTests: \(all.count) region cases, \(regions) regions, identical to silero-vad")
    }

    /// The same regions from float32 probabilities (what the package returns) as from their float64 values.
    func testFloat32ProbabilitiesGiveTheSameRegions() throws {
        for c in try cases("regions") {
            let options = try Self.options(c["options"])
            let n = (c["n_samples"] as! NSNumber).intValue
            let max = (c["max_speech_s"] as? NSNumber)?.doubleValue
            let doubles = Self.probabilities(c)
            guard doubles.allSatisfy({ Double(Float($0)) == $0 }) else { continue }  // float32 values only
            XCTAssertEqual(speechRegions(doubles.map(Float.init), sampleCount: n, options: options, maxSpeechSeconds: max),
                           speechRegions(doubles, sampleCount: n, options: options, maxSpeechSeconds: max))
        }
    }

    /// Every window case: the windows of Python's pack_windows.
    func testEveryWindowCaseMatchesThePythonRule() throws {
        let all = try cases("windows")
        XCTAssertGreaterThanOrEqual(all.count, 5)
        for c in all {
            let got = try packWindows(Self.spans(c["regions"]), sampleCount: (c["n_samples"] as! NSNumber).intValue,
                                      windowSamples: (c["window_samples"] as! NSNumber).intValue,
                                      maxGapSamples: (c["max_gap_samples"] as! NSNumber).intValue)
            XCTAssertEqual(got, Self.spans(c["expected"]), c["name"] as? String ?? "?")
        }
    }

    /// Every stream case: the events silero-vad's VADIterator gave, at the same chunks and samples.
    func testEveryStreamCaseMatchesVADIterator() throws {
        let all = try cases("stream")
        XCTAssertGreaterThanOrEqual(all.count, 5)
        var events = 0
        for c in all {
            var vad = StreamVAD(options: try Self.options(c["options"]))
            var got: [[String]] = []
            for (i, p) in Self.probabilities(c).enumerated() {
                switch vad.push(p) {
                case .start(let s)?: got.append([String(i), "start", String(s)])
                case .end(let s)?: got.append([String(i), "end", String(s)])
                case nil: break
                }
            }
            let expected = (c["expected"] as! [[Any]]).map { e in
                ["\((e[0] as! NSNumber).intValue)", e[1] as! String, "\((e[2] as! NSNumber).intValue)"]
            }
            XCTAssertEqual(got, expected, c["name"] as? String ?? "?")
            events += got.count
        }
        print("SpeechRegionsTests: \(all.count) stream cases, \(events) events, identical to VADIterator")
    }

    /// The defaults are Python's (the vectors' `defaults`, written from `VadOptions()`).
    func testDefaultsArePythons() throws {
        guard let defaults = Self.document["defaults"] as? [String: Any] else {
            return XCTFail("\(Self.vectors.path) has no 'defaults'")
        }
        XCTAssertEqual(try Self.options(defaults), VADOptions())
        let d = VADOptions()
        XCTAssertEqual((defaults["threshold"] as? NSNumber)?.doubleValue, d.threshold)
        XCTAssertEqual((defaults["min_speech_ms"] as? NSNumber)?.intValue, d.minSpeechMs)
        XCTAssertEqual((defaults["min_silence_ms"] as? NSNumber)?.intValue, d.minSilenceMs)
        XCTAssertEqual((defaults["speech_pad_ms"] as? NSNumber)?.intValue, d.speechPadMs)
        XCTAssertEqual((defaults["max_gap_s"] as? NSNumber)?.doubleValue, d.maxGapSeconds)
        XCTAssertTrue(defaults["neg_threshold"] is NSNull && defaults["max_speech_s"] is NSNull)
    }

    /// Regions that break the windows' preconditions are refused, naming the region.
    func testPackWindowsRefusesRegionsItWouldCut() {
        let cases: [([SampleSpan], String)] = [
            ([SampleSpan(start: 0, end: 1001)], "longer than the 1000-sample window"),
            ([SampleSpan(start: 500, end: 900), SampleSpan(start: 800, end: 950)], "overlap or are out of order"),
            ([SampleSpan(start: 100, end: 5000)], "outside the audio"),
            ([SampleSpan(start: -1, end: 10)], "outside the audio"),
        ]
        for (regions, message) in cases {
            XCTAssertThrowsError(try packWindows(regions, sampleCount: 4000, windowSamples: 1000, maxGapSamples: 100)) {
                XCTAssertTrue("\($0)".contains(message), "\($0)")
            }
        }
        XCTAssertEqual(try packWindows([], sampleCount: 4000, windowSamples: 1000, maxGapSamples: 100), [])
    }

    /// The options' ranges are Python's: each bad value is refused naming the option.
    func testOptionsOutOfRangeAreRefused() {
        let bad: [(VADOptions, String)] = [
            (VADOptions(threshold: 0), "threshold"), (VADOptions(threshold: 1), "threshold"),
            (VADOptions(threshold: .nan), "threshold"), (VADOptions(threshold: 0.5, negThreshold: 0.6), "neg_threshold"),
            (VADOptions(negThreshold: -0.1), "neg_threshold"), (VADOptions(minSpeechMs: -1), "min_speech_ms"),
            (VADOptions(minSilenceMs: -1), "min_silence_ms"), (VADOptions(speechPadMs: -5), "speech_pad_ms"),
            (VADOptions(maxSpeechSeconds: 0), "max_speech_s"), (VADOptions(maxSpeechSeconds: .nan), "max_speech_s"),
            (VADOptions(maxGapSeconds: -1), "max_gap_s"), (VADOptions(maxGapSeconds: .infinity), "max_gap_s"),
        ]
        for (options, name) in bad {
            XCTAssertThrowsError(try options.validate(), name) { XCTAssertTrue("\($0)".contains("VAD \(name) must"), "\($0)") }
        }
        XCTAssertNoThrow(try VADOptions().validate())
        XCTAssertNoThrow(try VADOptions(threshold: 0.3, negThreshold: 0.3, minSpeechMs: 0, maxSpeechSeconds: .infinity,
                                        maxGapSeconds: 0).validate())
        XCTAssertEqual(VADOptions().resolvedNegThreshold, 0.5 - 0.15)
        XCTAssertEqual(VADOptions(threshold: 0.1).resolvedNegThreshold, 0.01)
        XCTAssertEqual(VADOptions(maxSpeechSeconds: 50).maxSpeech(forWindow: 35), 35)
        XCTAssertEqual(VADOptions(maxSpeechSeconds: 10).maxSpeech(forWindow: 35), 10)
        XCTAssertEqual(VADOptions(maxGapSeconds: 2.0).maxGapSamples, 32000)
    }

    /// Python's `//`: towards minus infinity (a gap between padded regions can be negative).
    func testFloorDivisionIsPythons() {
        XCTAssertEqual([-3, -2, -1, 0, 1, 3].map { floorDivide($0, 2) }, [-2, -1, -1, 0, 0, 1])
    }
}
