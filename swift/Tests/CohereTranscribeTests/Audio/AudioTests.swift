@testable import CohereTranscribe
import Foundation
import XCTest

final class AudioTests: XCTestCase {
    func testWAVFormatsGivePythonsSamples() throws {
        let fixture = try Fixtures.json("audio.json") as! [String: Any]
        let variants = fixture["variants"] as! [[String: Any]]
        XCTAssertEqual(variants.count, 6)
        for v in variants {
            let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: v["wav"] as! String)).samples
            let want = try Fixtures.floats(v["samples_f32"] as! String)
            XCTAssertEqual(samples.count, want.count, "\(v)")
            let diff = zip(samples, want).map { abs($0 - $1) }.max() ?? 0
            XCTAssertEqual(diff, 0, "\(v["wav"]!): max difference \(diff)")  // exact, as Python reads it
        }
    }

    func testSplitPointsEqualPythons() throws {
        let fixture = try Fixtures.json("audio.json") as! [String: Any]
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        var longClips = 0
        for c in fixture["clips"] as! [[String: Any]] {
            let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: c["wav"] as! String)).samples
            XCTAssertEqual(samples.count, c["samples"] as! Int)
            let want = (c["split_points"] as! [[Int]]).map { $0[0]..<$0[1] }
            XCTAssertEqual(AudioSplitter.splitPoints(samples, manifest: manifest), want, c["wav"] as! String)
            if want.count > 1 { longClips += 1 }
        }
        XCTAssertEqual(longClips, 1)  // en_long_75s: three windows, cut at quiet points
    }

    func testSplitPointsDependOnTheEnergies() throws {
        // silence in the middle of the search range moves the cut there
        var x = [Float](repeating: 0.5, count: 16000 * 40)
        for i in 33 * 16000..<(33 * 16000 + 1600) { x[i] = 0 }
        let cuts = AudioSplitter.splitPoints(sampleCount: x.count, samples: x, sampleRate: 16000, maxClipSeconds: 35,
                                             overlapSeconds: 5, minEnergyWindow: 1600)
        XCTAssertEqual(cuts, [0..<(33 * 16000), (33 * 16000)..<x.count])
    }

    func testBadAudioIsAClearError() throws {
        let fixture = try Fixtures.json("audio.json") as! [String: Any]
        let adpcm = (fixture["unsupported"] as! [String])[0]
        XCTAssertThrowsError(try AudioInput.load(contentsOf: URL(fileURLWithPath: adpcm))) {
            XCTAssertTrue("\($0)".contains("format tag 0x0011 is not supported"), "\($0)")
        }
        XCTAssertThrowsError(try AudioInput.load(contentsOf: URL(fileURLWithPath: "/nonexistent.wav"))) {
            XCTAssertEqual($0 as? AudioError, .fileNotFound("/nonexistent.wav"))
        }
        XCTAssertThrowsError(try WAVReader.parse(Data("RIFF\0\0\0\0WAVE".utf8), name: "x.wav")) {
            XCTAssertTrue("\($0)".contains("without a fmt chunk"), "\($0)")
        }
        XCTAssertTrue(try AudioInput.isSilent([Float](repeating: 0, count: 16000), name: "quiet.wav"))
        XCTAssertTrue(try AudioInput.isSilent([Float](repeating: 0.99e-4, count: 16000), name: "quiet.wav"))
        XCTAssertFalse(try AudioInput.isSilent([0, 1e-4, 0], name: "speech.wav"))  // the threshold is Python's
        XCTAssertThrowsError(try AudioInput.isSilent([0.1, .nan], name: "nan.wav")) {
            XCTAssertTrue("\($0)".contains("NaN"), "\($0)")
        }
        XCTAssertThrowsError(try AudioInput.isSilent([], name: "empty.wav")) {
            XCTAssertTrue("\($0)".contains("empty"), "\($0)")
        }
        #if !(os(macOS) || os(iOS))
        let flac = Fixtures.repoRoot.appendingPathComponent("tests/data/audio/en_long_75s.flac")
        XCTAssertThrowsError(try AudioInput.load(contentsOf: flac)) {
            XCTAssertTrue("\($0)".contains("only WAV files"), "\($0)")
        }
        #endif
    }

    func testResamplerKeepsATone() {
        // 440 Hz at 44.1 kHz -> 16 kHz: same tone, same amplitude (away from the edges)
        let x = (0..<44100).map { Float(sin(2 * Double.pi * 440 * Double($0) / 44100)) }
        let y = Resampler.resample(x, from: 44100, to: 16000)
        XCTAssertEqual(y.count, 16000)
        let err = (1000..<15000).map { abs(y[$0] - Float(sin(2 * Double.pi * 440 * Double($0) / 16000))) }.max()!
        XCTAssertLessThan(err, 1e-3)
    }

    func testFloat16Conversion() {
        XCTAssertEqual(float16ToFloat(0x3C00), 1)
        XCTAssertEqual(float16ToFloat(0xC000), -2)
        XCTAssertEqual(float16ToFloat(0x0001), Float(sign: .plus, exponent: -24, significand: 1))
        XCTAssertEqual(float16ToFloat(0x7BFF), 65504)
        XCTAssertEqual(float16ToFloat(0xFC00), -.infinity)
        XCTAssertTrue(float16ToFloat(0x7E00).isNaN)
        XCTAssertEqual(float16ToFloat(0xF0E2), -10000)  // config.FP16_MASK_VALUE
    }
}
