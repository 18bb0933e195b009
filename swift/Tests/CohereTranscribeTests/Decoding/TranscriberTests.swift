@testable import CohereTranscribe
import Foundation
import XCTest

/// The Swift transcriber through the interpreter runtime against `cohere-coreml transcribe --json` (the
/// Python CLI), run by the fixture step on every demo clip (the Makefile's DEMO_CLIPS, as WAV) and every
/// held-out clip, window by window.
final class TranscriberTests: XCTestCase {
    /// Clips of transcripts_<frontEnd>.json: "package" (the CLI with --front-end package) or "python"
    /// (audio.log_mel, with each window's features).
    func clips(frontEnd: String) throws -> [[String: Any]] {
        (try Fixtures.json("transcripts_\(frontEnd).json") as! [String: Any])["clips"] as! [[String: Any]]
    }

    /// From audio files, the whole Swift path (WAV reader -> AudioSplitter -> frontend.mlpackage -> encoder
    /// bucket -> decoder with prefill): every window's token ids, text and stop reason equal the CLI's with
    /// the package front end; the clip texts too.
    func testAudioFileEqualsPythonCLI() async throws {
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        guard manifest.files.frontend != nil else {
            throw XCTSkip("the test bundle has no front-end package (frontend.mlpackage): this checkout's "
                + "`cohere-coreml export` does not write one, so audio files cannot be transcribed by the Swift package")
        }
        let clips = try clips(frontEnd: "package")
        XCTAssertEqual(clips.count, 94)  // 4 demo clips + 90 held-out
        for (runtimeName, runtime) in try Fixtures.runtimes() {
            let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime)
            var windows = 0, functions = Set<String>()
            for clip in clips {
                let wav = clip["wav"] as! String
                let r = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: wav), language: clip["language"] as! String,
                                                         vad: .off)  // the references: the energy windows
                let want = clip["windows"] as! [[String: Any]]
                XCTAssertEqual(r.windows.count, want.count, wav)
                for (got, w) in zip(r.windows, want) {
                    let name = "\(runtimeName): \(wav) window \(w["index"]!)"
                    XCTAssertEqual(got.tokenIds, w["token_ids"] as! [Int], name)
                    XCTAssertEqual(got.text, w["text"] as! String, name)
                    XCTAssertEqual(got.stopReason.rawValue, w["stop_reason"] as! String, name)
                    XCTAssertEqual(got.timings.encoderFunction, w["encoder_function"] as! String, name)
                    XCTAssertFalse(got.text.isEmpty, name)
                    functions.insert(got.timings.encoderFunction)
                    windows += 1
                }
                XCTAssertEqual(r.text, clip["text"] as! String, "\(runtimeName): \(wav)")
            }
            XCTAssertEqual(windows, 96, runtimeName)  // en_long_75s has three windows
            XCTAssertEqual(functions, ["main", "window_10s"], runtimeName)  // both encoder buckets (and front-end functions) ran
        }
    }

    /// The encoder/decoder loop alone, given Python's features (audio.log_mel): every window equals the CLI
    /// with the Python front end. The test bundle's decoder is the host-state variant (the default): each
    /// window's state writes are checked as `StateWriteCheck` says (the other variant, bundle-graph/, is
    /// checked the same way by testBothDecoderStateVariantsGiveThePythonTokens).
    func testTokenIdsEqualPythonGivenPythonFeatures() async throws {
        let clips = try clips(frontEnd: "python")
        XCTAssertEqual(clips.count, 94)
        for (runtimeName, runtime) in try Fixtures.runtimes() {
            let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime)
            let manifest = transcriber.manifest
            XCTAssertTrue(manifest.decoder.hostWritesState, "the test bundle is the default (host-state) export")
            let writes = StateWriteCheck(manifest: manifest, runtimeName: runtimeName)
            var windows = 0
            for clip in clips {
                let language = clip["language"] as! String
                var texts: [String] = []
                for w in clip["windows"] as! [[String: Any]] {
                    let frames = w["frames"] as! Int
                    let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                              shape: [1, manifest.encoder.numMelBins, frames])
                    let r = try await transcriber.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int,
                                                                   prompt: try manifest.prompt(language: language))
                    let name = "\(runtimeName): \(clip["wav"]!) window \(w["index"]!)"
                    XCTAssertEqual(r.tokenIds, w["token_ids"] as! [Int], name)
                    XCTAssertEqual(r.text, w["text"] as! String, name)
                    XCTAssertEqual(r.stopReason.rawValue, w["stop_reason"] as! String, name)
                    XCTAssertEqual(r.timings.encoderFunction, w["encoder_function"] as! String, name)
                    writes.check(r, name)
                    texts.append(r.text)
                    windows += 1
                }
                XCTAssertEqual(Detokenizer.joinWindows(texts, language: language), clip["text"] as! String)
            }
            XCTAssertEqual(windows, 96, runtimeName)
            writes.finish()
        }
    }

    /// What a decoder state variant writes, checked window by window: a host-state window writes the memory
    /// once and then exactly one K/V row per layer and fed token slot; a graph-state window writes nothing.
    /// On the Linux Core ML emulation the host's writes must have gone through `MLState.withMultiArray(for:)`.
    struct StateWriteCheck {
        let host: Bool, rowBytes: Int, memoryBytes: Int, runtimeName: String
        #if os(Linux)
        let viewsBefore = CoreMLEmulation.statistics.stateViews
        #endif

        init(manifest: BundleManifest, runtimeName: String) {
            host = manifest.decoder.hostWritesState
            let c = manifest.decoder.cacheShape, m = manifest.decoder.memoryShape
            rowBytes = 2 * c[0] * c[1] * c[3] * 2  // new_k + new_v: one fp16 row per layer and KV head
            memoryBytes = 2 * m.reduce(1, *) * 2 + manifest.encoder.memoryLength * 2
            self.runtimeName = runtimeName
        }

        func check(_ r: WindowResult, _ name: String) {
            XCTAssertEqual(r.timings.decoderStateBytesWritten, host ? memoryBytes + rowBytes * r.timings.decoderTokensFed : 0, name)
        }

        func finish() {
            #if os(Linux)
            if runtimeName != "interpreter" {
                XCTAssertEqual(CoreMLEmulation.statistics.stateViews > viewsBefore, host, runtimeName)
            }
            #endif
        }
    }

    /// The encoder in parts (bundle-parts/: `--encoder-parts 2`, the test bundle's decoder and front end): the
    /// manifest lists two programs of consecutive layers, the transcriber loads both for every bucket and chains
    /// them, and given Python's features every held-out window's tokens equal the Python CLI's on that bundle
    /// through both runtimes (and the whole-encoder bundle's: the parts compute the same arithmetic).
    func testEncoderInPartsGivesThePythonTokens() async throws {
        let url = Fixtures.dir.appendingPathComponent("bundle-parts")
        let manifest = try BundleManifest.load(bundle: url)
        XCTAssertEqual(manifest.encoder.parts.map(\.file), ["encoder", "encoder_part2"])
        XCTAssertEqual(manifest.encoder.parts.map(\.layers), [[0, 2], [2, 4]])
        XCTAssertEqual(manifest.files.encoderParts, ["encoder_part2": "encoder_part2.mlpackage"])
        let partClips = try clips(frontEnd: "parts").filter { ($0["wav"] as! String).contains("heldout") }
        let whole = Dictionary(uniqueKeysWithValues: try clips(frontEnd: "python").map { ($0["wav"] as! String, $0) })
        XCTAssertEqual(partClips.count, 90)
        for (runtimeName, runtime) in try Fixtures.runtimes() {
            let transcriber = try await CohereTranscriber(bundle: url, runtime: runtime)
            try await transcriber.prewarm()
            let loaded = await transcriber.loadedFunctions
            XCTAssertTrue(loaded.contains("encoder_part2/window_10s"), "\(loaded)")
            var windows = 0, sameAsWhole = 0
            for clip in partClips {
                let language = clip["language"] as! String
                let wholeWindows = whole[clip["wav"] as! String]?["windows"] as? [[String: Any]] ?? []
                for (i, w) in (clip["windows"] as! [[String: Any]]).enumerated() {
                    let frames = w["frames"] as! Int
                    let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                              shape: [1, manifest.encoder.numMelBins, frames])
                    let r = try await transcriber.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int,
                                                                   prompt: try manifest.prompt(language: language))
                    let name = "\(runtimeName): \(clip["wav"]!) window \(w["index"]!)"
                    XCTAssertEqual(r.tokenIds, w["token_ids"] as! [Int], name)
                    XCTAssertEqual(r.stopReason.rawValue, w["stop_reason"] as! String, name)
                    let wholeIds = i < wholeWindows.count ? wholeWindows[i]["token_ids"] as? [Int] : nil
                    if r.tokenIds == wholeIds { sameAsWhole += 1 }
                    windows += 1
                }
            }
            XCTAssertEqual(windows, 90, runtimeName)
            XCTAssertEqual(sameAsWhole, windows, "\(runtimeName): the parts' tokens differ from the whole encoder's")
        }
    }

    /// Both decoder state variants give the Python CLI's tokens: the test bundle's (host state, the default:
    /// testTokenIdsEqualPythonGivenPythonFeatures runs it on every clip with these checks) and the other one,
    /// bundle-graph/ (same encoder), here: given Python's features, every held-out window's tokens equal the
    /// Python CLI's through both runtimes (the interpreter, and Core ML), its state writes as `StateWriteCheck`
    /// says.
    func testBothDecoderStateVariantsGiveThePythonTokens() async throws {
        let clips = try clips(frontEnd: "python").filter { ($0["wav"] as! String).contains("heldout") }
        XCTAssertEqual(clips.count, 90)
        var variants: [String: URL] = [:]
        for url in [Fixtures.bundle, Fixtures.dir.appendingPathComponent("bundle-graph"),
                    Fixtures.dir.appendingPathComponent("bundle-host")]
        where FileManager.default.fileExists(atPath: url.appendingPathComponent("manifest.json").path) {
            variants[try BundleManifest.load(bundle: url).decoder.stateWrites ?? "graph"] = url
        }
        XCTAssertEqual(Set(variants.keys), ["host", "graph"], "run `make swift-fixtures`: it writes both variants")
        XCTAssertEqual(variants["host"], Fixtures.bundle, "the test bundle is the host-state variant")
        let url = try XCTUnwrap(variants["graph"])
        for (runtimeName, runtime) in try Fixtures.runtimes() {
            let transcriber = try await CohereTranscriber(bundle: url, runtime: runtime)
            let manifest = transcriber.manifest
            XCTAssertFalse(manifest.decoder.hostWritesState)
            let writes = StateWriteCheck(manifest: manifest, runtimeName: runtimeName)
            var windows = 0
            for clip in clips {
                for w in clip["windows"] as! [[String: Any]] {
                    let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                              shape: [1, manifest.encoder.numMelBins, w["frames"] as! Int])
                    let r = try await transcriber.transcribeWindow(
                        features: features, validFrames: w["valid_frames"] as! Int,
                        prompt: try manifest.prompt(language: clip["language"] as! String))
                    let name = "graph \(runtimeName): \(clip["wav"]!) window \(w["index"]!)"
                    XCTAssertEqual(r.tokenIds, w["token_ids"] as! [Int], name)
                    writes.check(r, name)
                    windows += 1
                }
            }
            XCTAssertEqual(windows, 90)
            writes.finish()
        }
    }

    /// The front-end package gives the encoder what audio.log_mel gives, to the bit or near it: a window
    /// through the package front end and the same window given Python's features decode alike; a
    /// front end fed the wrong length does not.
    func testFrontEndPackageFeaturesMatchPythonFeatures() async throws {
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        guard manifest.files.frontend != nil else { throw XCTSkip("the test bundle has no front-end package") }
        let clip = try clips(frontEnd: "python").first { ($0["group"] as! String) == "heldout" }!
        let w = (clip["windows"] as! [[String: Any]])[0]
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        let samples = try AudioInput.load(contentsOf: URL(fileURLWithPath: clip["wav"] as! String)).samples
        let (features, valid) = try await transcriber.features(of: samples)
        XCTAssertEqual(valid, w["valid_frames"] as! Int)
        XCTAssertEqual(features.shape, [1, manifest.encoder.numMelBins, w["frames"] as! Int])
        let want = try Fixtures.floats(w["features"] as! String)
        let got = features.floats()
        let maxDiff = zip(got, want).map { abs($0 - $1) }.max()!
        XCTAssertLessThan(maxDiff, 5e-4)  // the front-end package's export gate (frontend.GATE_MAX_ABS_DIFF)
        let (shorter, shorterValid) = try await transcriber.features(of: Array(samples.dropLast(1600)))
        XCTAssertEqual(shorterValid, valid - 10)
        XCTAssertGreaterThan(zip(shorter.floats(), want).map { abs($0 - $1) }.max()!, 0.01)  // the check can fail
    }

    /// Without prefill (prompt fed token by token, or by the extend function) the tokens are the same;
    /// maxNewTokens truncates exactly.
    func testPromptPathsAndTruncation() async throws {
        let clip = try clips(frontEnd: "python")[0]
        let w = (clip["windows"] as! [[String: Any]])[0]
        let want = w["token_ids"] as! [Int]
        let runtime = try Fixtures.interpreter()
        let stepwise = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime, usePrefill: false,
                                                   useExtend: false)
        let features = try Tensor(float32: try Fixtures.floats(w["features"] as! String),
                                  shape: [1, stepwise.manifest.encoder.numMelBins, w["frames"] as! Int])
        let prompt = try stepwise.manifest.prompt(language: clip["language"] as! String)
        let full = try await stepwise.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int, prompt: prompt)
        XCTAssertEqual(full.tokenIds, want)
        XCTAssertEqual(full.timings.decoderCalls, prompt.count + want.count - 1)  // no prefill: one call per prompt token
        // the prompt through the extend function instead (the bundle has one): one call of 32 slots
        let extended = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime, usePrefill: false)
        let viaExtend = try await extended.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int,
                                                            prompt: prompt)
        XCTAssertEqual(viaExtend.tokenIds, want)
        XCTAssertEqual(viaExtend.timings.decoderCalls, 1 + want.count - 1)
        XCTAssertEqual(viaExtend.timings.decoderTokensFed, 32 + want.count - 1)
        let cut = try await stepwise.transcribeWindow(features: features, validFrames: w["valid_frames"] as! Int,
                                                      prompt: prompt, maxNewTokens: 3)
        XCTAssertEqual(cut.tokenIds, Array(want.prefix(3)))
        XCTAssertTrue(cut.truncated)
        XCTAssertEqual(cut.stopReason, .maxNewTokens)
        do {
            _ = try await stepwise.transcribeWindow(features: features, validFrames: 10, prompt: prompt, maxNewTokens: 0)
            XCTFail("maxNewTokens 0 accepted")
        } catch let error as TranscriptionError {
            XCTAssertTrue("\(error)".contains("maxNewTokens must be >= 1"))
        }
    }

    /// A long file's windows arrive one by one as they are decoded (the same as the whole-file result);
    /// cancelling stops between windows with `CancellationError`; `unload()` frees every model and the
    /// next call loads them again.
    func testWindowStreamCancellationAndUnload() async throws {
        let clip = try clips(frontEnd: "package").first { ($0["wav"] as! String).contains("en_long_75s") }!
        let url = URL(fileURLWithPath: clip["wav"] as! String)
        let want = (clip["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] }
        XCTAssertEqual(want.count, 3)
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        var streamed: [[Int]] = []
        for try await window in transcriber.windows(contentsOf: url, language: "en", vad: .off) { streamed.append(window.tokenIds) }
        XCTAssertEqual(streamed, want)

        final class Seen: @unchecked Sendable { var windows = 0 }
        let seen = Seen()
        let task = Task {
            try await transcriber.transcribe(contentsOf: url, language: "en", vad: .off) { _ in
                seen.windows += 1
                withUnsafeCurrentTask { $0?.cancel() }  // cancelled after the first window
            }
        }
        do {
            _ = try await task.value
            XCTFail("a cancelled transcription returned a result")
        } catch is CancellationError {
            XCTAssertEqual(seen.windows, 1)
        }

        let loaded = await transcriber.loadedFunctions
        XCTAssertTrue(loaded.contains("decoder/main") && loaded.contains("encoder/main"), "\(loaded)")
        await transcriber.unload()
        let afterUnload = await transcriber.loadedFunctions
        XCTAssertEqual(afterUnload, [])
        let again = try await transcriber.transcribe(contentsOf: url, language: "en", vad: .off)
        XCTAssertEqual(again.tokenIds, want)
        let reloaded = await transcriber.loadedFunctions
        XCTAssertFalse(reloaded.isEmpty)
    }

    /// Concurrent transcriptions on one actor (each with its own decoder state) give exactly the sequential
    /// results, and cancelling some of them does not disturb the others.
    func testConcurrentTranscriptionsAndCancellationsEqualSequentialOnes() async throws {
        let picked = Array(try clips(frontEnd: "package").filter { ($0["group"] as? String) == "heldout" }.prefix(6))
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.coreML())
        var sequential: [[[Int]]] = []
        for clip in picked {
            let r = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: clip["wav"] as! String),
                                                     language: clip["language"] as! String, vad: .off)
            sequential.append(r.tokenIds)
        }
        XCTAssertEqual(sequential, picked.map { ($0["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] } })
        let tasks = picked.map { clip in
            Task { try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: clip["wav"] as! String),
                                                    language: clip["language"] as! String, vad: .off).tokenIds }
        }
        let cancelled: Set<Int> = [1, 4]
        for i in cancelled { tasks[i].cancel() }
        for (i, task) in tasks.enumerated() {
            do {
                let got = try await task.value
                if !cancelled.contains(i) { XCTAssertEqual(got, sequential[i], "clip \(i)") }
            } catch is CancellationError {
                XCTAssertTrue(cancelled.contains(i), "clip \(i) was cancelled without being asked")
            }
        }
    }

    func testBadInputsAreClearErrors() async throws {
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: try Fixtures.interpreter())
        let wav = (try clips(frontEnd: "python")[0])["wav"] as! String
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
        // digital silence: an empty transcript marked silent, as `cohere-coreml transcribe` gives it
        let silence = try await transcriber.transcribe(samples: [Float](repeating: 0, count: 32000), language: "en")
        XCTAssertTrue(silence.silent)
        XCTAssertEqual(silence.text, "")
        XCTAssertTrue(silence.windows.isEmpty)
        do {
            _ = try await transcriber.transcribe(samples: [0.1, .infinity, 0.2], language: "en")
            XCTFail("inf samples accepted")
        } catch let error as AudioError {
            XCTAssertTrue("\(error)".contains("NaN/inf"), "\(error)")
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
        #if os(macOS) || os(Linux)
        XCTAssertThrowsError(try InterpreterRuntime(executable: URL(fileURLWithPath: "/nonexistent/cohere-coreml"))) {
            XCTAssertTrue("\($0)".contains("not found"), "\($0)")
        }
        #endif
    }
}
