@testable import CohereTranscribe
import Foundation
import XCTest

/// The test bundle's real vad.mlpackage through the interpreter runtime against Python (vad_regions.json, written
/// by `make swift-fixtures` with the Python package runtime and silero-vad's own region rule): the same
/// probabilities, the same speech regions, and a transcription with the VAD on that decodes only them.
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
        for clip in clips {
            let wav = clip["wav"] as! String
            let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: wav)).samples
            XCTAssertEqual(samples.count, clip["samples"] as? Int, wav)
            let want = (clip["probabilities"] as! [NSNumber]).map(\.floatValue)
            let got = try await transcriber.speechProbabilities(samples)
            XCTAssertEqual(got.count, want.count, wav)
            let worst = zip(got, want).map { abs($0 - $1) }.max() ?? 0
            XCTAssertLessThanOrEqual(worst, Self.tolerance, wav)
            let expected = (clip["regions"] as! [[Int]]).map { SampleSpan(start: $0[0], end: $0[1]) }
            let found = try await transcriber.speechRegions(samples)
            XCTAssertEqual(found, expected, wav)
            regions += expected.count
        }
        print("VADEndToEndTests: \(clips.count) clips, \(regions) regions, identical to Python's")
        // the sparse clip (two clips and a pause longer than a window bridges) with the VAD on: one window per
        // stretch of speech, the pause never decoded, the windows at their offsets
        let sparse = clips.last!
        let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: sparse["wav"] as! String)).samples
        let result = try await transcriber.transcribe(samples: samples, language: "en", vad: .on)
        let expected = (sparse["regions"] as! [[Int]]).map { SampleSpan(start: $0[0], end: $0[1]) }
        XCTAssertEqual(result.speechRegions, expected)
        let windows = try XCTUnwrap(result.speechWindows)
        XCTAssertGreaterThanOrEqual(windows.count, 2)
        XCTAssertEqual(result.windows.map(\.startSeconds), windows.map { Double($0.start) / 16000 })
        XCTAssertLessThan(result.vadSummary?.decodedShare ?? 1, 1)
    }
}
