@testable import CohereTranscribe
import Foundation
import XCTest

/// The Swift transcriber through the interpreter runtime against Python's `Transcriber` (the fixture was
/// written by Python's `Transcriber.transcribe`, the same loop `cohere-coreml transcribe --json` runs).
final class TranscriberTests: XCTestCase {
    func clips() throws -> [[String: Any]] {
        (try Fixtures.json("transcripts.json") as! [String: Any])["clips"] as! [[String: Any]]
    }

    /// Every window of the demo clips and the held-out set: same encoder function, same token ids, same
    /// text, same stop reason. Features are Python's (the bundle has no front-end package yet).
    func testTokenIdsEqualPythonOnEveryWindow() async throws {
        let clips = try clips()
        XCTAssertEqual(clips.count, 94)  // 4 demo clips + 90 held-out
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        let manifest = transcriber.manifest
        var windows = 0
        for clip in clips {
            let language = clip["language"] as! String
            var texts: [String] = []
            for w in clip["windows"] as! [[String: Any]] {
                let frames = w["frames"] as! Int
                let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                          shape: [1, manifest.encoder.num_mel_bins, frames])
                let r = try await transcriber.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int,
                                                               prompt: try manifest.prompt(language: language))
                let name = "\(clip["wav"]!) window \(w["index"]!)"
                XCTAssertEqual(r.tokenIds, w["token_ids"] as! [Int], name)
                XCTAssertEqual(r.text, w["text"] as! String, name)
                XCTAssertEqual(r.stopReason, w["stop_reason"] as! String, name)
                XCTAssertEqual(r.timings.encoderFunction, w["encoder_function"] as! String, name)
                XCTAssertFalse(r.text.isEmpty, name)
                texts.append(r.text)
                windows += 1
            }
            XCTAssertEqual(Detokenizer.joinWindows(texts, language: language), clip["text"] as! String)
        }
        XCTAssertGreaterThanOrEqual(windows, 96)
    }

    /// Without prefill (prompt fed token by token) the tokens are the same; maxNewTokens truncates exactly.
    func testPromptPathsAndTruncation() async throws {
        let clip = try clips()[0]
        let w = (clip["windows"] as! [[String: Any]])[0]
        let want = w["token_ids"] as! [Int]
        let runtime = try Fixtures.interpreter()
        let stepwise = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime, usePrefill: false)
        let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                  shape: [1, stepwise.manifest.encoder.num_mel_bins, w["frames"] as! Int])
        let prompt = try stepwise.manifest.prompt(language: clip["language"] as! String)
        let full = try await stepwise.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int, prompt: prompt)
        XCTAssertEqual(full.tokenIds, want)
        XCTAssertEqual(full.timings.decoderCalls, prompt.count + want.count - 1)  // no prefill: one call per prompt token
        let cut = try await stepwise.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int,
                                                      prompt: prompt, maxNewTokens: 3)
        XCTAssertEqual(cut.tokenIds, Array(want.prefix(3)))
        XCTAssertTrue(cut.truncated)
        XCTAssertEqual(cut.stopReason, "max_new_tokens")
        do {
            _ = try await stepwise.transcribeWindow(features: features, validFrames: 10, prompt: prompt, maxNewTokens: 0)
            XCTFail("maxNewTokens 0 accepted")
        } catch let error as TranscriptionError {
            XCTAssertTrue("\(error)".contains("maxNewTokens must be >= 1"))
        }
    }

    /// From an audio file: needs the bundle's front-end package (frontend.mlpackage, issue 11's export).
    func testAudioFileEqualsPython() async throws {
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        guard manifest.files.frontend != nil else {
            throw XCTSkip("the test bundle has no front-end package (frontend.mlpackage, not exported by this branch yet): "
                + "audio-file transcription is covered once the front-end export lands")
        }
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        for clip in try clips() {
            let r = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: clip["wav"] as! String),
                                                     language: clip["language"] as! String)
            XCTAssertEqual(r.tokenIds, (clip["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] })
            XCTAssertEqual(r.text, clip["text"] as! String)
        }
    }

    func testBadInputsAreClearErrors() async throws {
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        let wav = (try clips()[0])["wav"] as! String
        do {
            _ = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: wav), language: "xx")
            XCTFail("unknown language accepted")
        } catch let error as BundleError {
            XCTAssertTrue("\(error)".contains("unsupported language 'xx'"))
        }
        do {
            _ = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: "/missing.wav"), language: "en")
            XCTFail("missing file accepted")
        } catch let error as AudioError {
            XCTAssertEqual(error, .fileNotFound("/missing.wav"))
        }
        do {
            _ = try await transcriber.transcribe(samples: [Float](repeating: 0, count: 32000), language: "en")
            XCTFail("silence accepted")
        } catch let error as AudioError {
            XCTAssertTrue("\(error)".contains("silent"))
        }
        do {
            let features = try Tensor(float32: [Float](repeating: 0, count: 128 * 999), shape: [1, 128, 999])
            _ = try await transcriber.transcribeWindow(features: features, validFrames: 10, prompt: [1])
            XCTFail("features of no encoder window accepted")
        } catch let error as TranscriptionError {
            XCTAssertTrue("\(error)".contains("999 frames"), "\(error)")
        }
        do {
            _ = try await CohereTranscriber(bundle: URL(fileURLWithPath: "/nonexistent-bundle"), runtime: try Fixtures.interpreter())
            XCTFail("missing bundle accepted")
        } catch let error as BundleError {
            XCTAssertTrue("\(error)".contains("no manifest.json"))
        }
        XCTAssertThrowsError(try InterpreterRuntime(executable: URL(fileURLWithPath: "/nonexistent/cohere-coreml"))) {
            XCTAssertTrue("\($0)".contains("not found"), "\($0)")
        }
    }
}
