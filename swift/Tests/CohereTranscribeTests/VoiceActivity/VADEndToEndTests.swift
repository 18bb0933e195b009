@testable import CohereTranscribe
import Foundation
import XCTest

/// The test bundle's real vad.mlpackage through the interpreter runtime against Python (vad_regions.json, written
/// by `make swift-fixtures` with the Python package runtime and silero-vad's own region rule): the same
/// probabilities, the same speech regions, and the sparse clip transcribed with the VAD on as the Python CLI
/// transcribes it (`cohere-coreml transcribe --vad on`): the same windows at the same offsets, the same tokens.
final class VADEndToEndTests: XCTestCase {
    /// The probabilities come from the same interpreter in both languages; only the torch threads' summation
    /// order may differ in the last bits.
    static let tolerance: Float = 1e-5

    func reference() throws -> [String: Any] {
        let path = try Fixtures.require().appendingPathComponent("vad_regions.json")
        guard FileManager.default.fileExists(atPath: path.path) else {
            throw XCTSkip("the test bundle has no VAD (vad_regions.json is written when it has one)")
        }
        return try Fixtures.json("vad_regions.json") as! [String: Any]
    }

    func testRegionsOfTheBundlesVADArePythons() async throws {
        let ref = try reference()
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        XCTAssertEqual(transcriber.manifest.vad?.functions["block"]?.chunks, ref["chunks"] as? Int)
        let clips = ref["clips"] as! [[String: Any]]
        XCTAssertGreaterThanOrEqual(clips.count, 2)
        var regions = 0
        var worst: Float = 0
        for clip in clips {
            let wav = clip["wav"] as! String
            let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: wav)).samples
            XCTAssertEqual(samples.count, clip["samples"] as? Int, wav)
            let want = (clip["probabilities"] as! [NSNumber]).map(\.floatValue)
            let got = try await transcriber.speechProbabilities(samples)
            XCTAssertEqual(got.count, want.count, wav)
            let diff = zip(got, want).map { abs($0 - $1) }.max() ?? 0
            XCTAssertLessThanOrEqual(diff, Self.tolerance, wav)
            worst = max(worst, diff)
            let expected = (clip["regions"] as! [[Int]]).map { SampleSpan(start: $0[0], end: $0[1]) }
            let found = try await transcriber.speechRegions(samples)
            XCTAssertEqual(found, expected, wav)
            regions += expected.count
        }
        print("VADEndToEndTests: \(clips.count) clips, \(regions) regions as Python's, probabilities within \(worst)")

        // the sparse clip (two clips and a pause longer than a window bridges) with the VAD on: the Python CLI's
        // windows, at its offsets, with its tokens; the pause never decoded
        let sparse = clips.last!
        let python = ref["sparse_transcript"] as! [String: Any]
        let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: sparse["wav"] as! String)).samples
        let result = try await transcriber.transcribe(samples: samples, language: "en", vad: .on)
        XCTAssertEqual(result.speechRegions, (sparse["regions"] as! [[Int]]).map { SampleSpan(start: $0[0], end: $0[1]) })
        let want = python["windows"] as! [[String: Any]]
        XCTAssertGreaterThanOrEqual(want.count, 2)
        XCTAssertEqual(result.windows.count, want.count)
        for (got, w) in zip(result.windows, want) {
            XCTAssertEqual(got.index, w["index"] as? Int)
            XCTAssertEqual(got.startSeconds, w["start_s"] as! Double, accuracy: 1e-9)
            XCTAssertEqual(got.durationSeconds, w["duration_s"] as! Double, accuracy: 1e-9)
            XCTAssertEqual(got.tokenIds, w["token_ids"] as? [Int])
        }
        XCTAssertEqual(result.text, python["text"] as? String)
        let summary = try XCTUnwrap(result.vadSummary)
        let vad = python["vad"] as! [String: Any]
        XCTAssertEqual(summary.windows, vad["windows"] as? Int)
        XCTAssertEqual(summary.regions, vad["regions"] as? Int)
        XCTAssertEqual(summary.decodedSeconds, vad["decoded_s"] as! Double, accuracy: 1e-3)
        XCTAssertLessThan(summary.decodedShare, 1)
    }
}
