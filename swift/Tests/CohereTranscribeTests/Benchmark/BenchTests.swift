@testable import CohereTranscribe
import Foundation
import XCTest

/// `DeviceBenchmark` (what `cohere-transcribe-swift bench` runs) on the fixture bundle through the interpreter
/// runtime, over a dataset folder of three held-out clips (+ one entry whose file is missing), against the
/// Python CLI's transcripts (transcripts_package.json) and Python's reading of the same dataset folder.
final class BenchTests: XCTestCase {
    /// A dataset folder in the held-out set's format: 3 held-out clips as WAV (the fixture step's copies),
    /// their references from tests/data/heldout/manifest.json, and one entry whose file does not exist.
    func makeDataset() throws -> (URL, [[String: Any]]) {
        let fixtures = try Fixtures.require()
        let clips = ((try Fixtures.json("transcripts_package.json") as! [String: Any])["clips"] as! [[String: Any]])
            .filter { ($0["group"] as! String) == "heldout" }
        var picked: [[String: Any]] = []
        for language in ["en", "de", "es"] {
            picked.append(clips.first { ($0["language"] as! String) == language }!)
        }
        let heldout = try JSONSerialization.jsonObject(with: Data(contentsOf: Fixtures.repoRoot
            .appendingPathComponent("tests/data/heldout/manifest.json"))) as! [String: Any]
        var references: [String: String] = [:]
        for u in heldout["utterances"] as! [[String: Any]] {
            references[(u["file"] as! NSString).deletingPathExtension] = u["text"] as? String
        }
        let dir = Fixtures.scratch.appendingPathComponent("bench-tests-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        addTeardownBlock { try? FileManager.default.removeItem(at: dir) }
        var entries: [[String: Any]] = []
        for clip in picked {
            let name = ((clip["wav"] as! String) as NSString).lastPathComponent
            try FileManager.default.copyItem(at: fixtures.appendingPathComponent("wav").appendingPathComponent(name),
                                             to: dir.appendingPathComponent(name))
            let stem = (name as NSString).deletingPathExtension
            entries.append(["file": name, "text": try XCTUnwrap(references[stem], stem), "language": clip["language"]!])
        }
        entries.append(["file": "gone.wav", "text": "nothing here", "language": "en"])
        let manifest = try JSONSerialization.data(withJSONObject: ["split": "heldout", "utterances": entries],
                                                  options: [.prettyPrinted, .sortedKeys])
        try manifest.write(to: dir.appendingPathComponent("manifest.json"))
        return (dir, picked)
    }

    /// Python's `load_folder` on `dir`: the manifest sha256, and per entry its id, language and whether it is a problem.
    func pythonDataset(_ dir: URL) throws -> [String: Any] {
        #if os(macOS) || os(Linux)
        let process = Process()
        process.executableURL = Fixtures.repoRoot.appendingPathComponent(".venv/bin/python")
        process.arguments = ["-c", """
            import json, sys
            from cohere_coreml.evaluation.datasets import load_folder
            d = load_folder(sys.argv[1])
            print(json.dumps({"sha256": d.manifest_sha256, "clips": [[c.id, c.language, c.problem is not None] for c in d.clips]}))
            """, dir.path]
        let out = Pipe()
        process.standardOutput = out
        try process.run()
        let data = out.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        XCTAssertEqual(process.terminationStatus, 0)
        return try JSONSerialization.jsonObject(with: data) as! [String: Any]
        #else
        throw XCTSkip("Python's reading of the dataset \(Fixtures.noChildProcesses)")
        #endif
    }

    func testBenchOnHeldOutClipsThroughTheInterpreter() async throws {
        let (dir, picked) = try makeDataset()
        var options = DeviceBenchmark.Options(bundle: Fixtures.bundle, dataset: dir.path)
        options.vad = .off  // the references: the energy windows
        let report = try await DeviceBenchmark.run(options, runtime: try Fixtures.interpreter())

        // the dataset as Python reads it: same manifest sha256, same entries and problems
        let python = try pythonDataset(dir)
        XCTAssertEqual(report.dataset.manifestSHA256, python["sha256"] as? String)
        XCTAssertEqual(report.dataset.manifestSHA256.count, 64)
        let pyClips = python["clips"] as! [[Any]]
        XCTAssertEqual(report.clips.map(\.id), pyClips.map { $0[0] as! String })
        XCTAssertEqual(report.clips.map(\.language), pyClips.map { $0[1] as! String })
        XCTAssertEqual(report.clips.map { $0.status == "problem" }, pyClips.map { $0[2] as! Bool })
        XCTAssertEqual(report.dataset.clips, 4)

        // token ids, stop reasons and text of every window equal the Python CLI's (transcripts_package.json)
        XCTAssertEqual(report.clips.count, 4)
        for (clip, want) in zip(report.clips, picked) {
            let windows = want["windows"] as! [[String: Any]]
            XCTAssertEqual(clip.status, "ok", clip.id)
            XCTAssertEqual(clip.tokenIds, windows.map { $0["token_ids"] as! [Int] }, clip.id)
            XCTAssertEqual(clip.stopReasons, windows.map { $0["stop_reason"] as! String }, clip.id)
            XCTAssertEqual(clip.hypothesis, want["text"] as? String, clip.id)
            XCTAssertEqual(clip.windows?.map(\.encoderFunction), windows.map { $0["encoder_function"] as! String })
            XCTAssertEqual(clip.audioSeconds!, Double(want["samples"] as! Int) / 16000, accuracy: 1e-9)
        }
        let gone = report.clips[3]
        XCTAssertEqual(gone.status, "problem")
        XCTAssertTrue(gone.problem?.hasPrefix("audio file not found: ") == true, "\(gone.problem ?? "-")")
        XCTAssertNil(gone.tokenIds)
        XCTAssertEqual(report.failedClips, 1)

        // placement: the emulated MLComputePlan refuses on Linux (and the interpreter is no Core ML elsewhere)
        XCTAssertTrue(report.placement.isUnavailable)
        #if os(Linux)
        XCTAssertTrue(report.placementReason?.contains("not available on Linux") == true, "\(report.placementReason ?? "-")")
        #endif

        // loads, stages, totals
        XCTAssertGreaterThan(report.load.cold, 0)
        XCTAssertGreaterThan(report.load.warm, 0)
        XCTAssertEqual(report.load.cold, report.load.coldInit + report.load.coldPrewarm, accuracy: 1e-9)
        XCTAssertGreaterThan(report.load.coldTranscriberLoad, 0)
        XCTAssertLessThanOrEqual(report.load.coldTranscriberLoad, report.load.cold)
        XCTAssertNotNil(report.firstRunSeconds)
        let windows = report.clips.flatMap { $0.windows ?? [] }
        XCTAssertEqual(windows.count, 3)
        for w in windows {
            for t in [w.featuresSeconds, w.encoderSeconds, w.promptSeconds, w.decodeSeconds] { XCTAssertGreaterThanOrEqual(t, 0) }
            XCTAssertGreaterThan(w.encoderSeconds, 0)
            XCTAssertEqual(w.decoderCalls, w.tokenIds.count)  // prefill (1 call) + one step per token but the last
        }
        let t = report.totals
        XCTAssertEqual(t.clips, 4)
        XCTAssertEqual(t.clipsOK, 3)
        XCTAssertEqual(t.clipsFailed, 1)
        XCTAssertEqual(Set(t.stages.keys), ["features_s", "encoder_s", "prompt_s", "decode_s"])
        XCTAssertEqual(t.stages["encoder_s"]!, windows.reduce(0) { $0 + $1.encoderSeconds }, accuracy: 1e-9)
        XCTAssertEqual(t.decodeTokens, picked.reduce(0) { n, c in
            n + (c["windows"] as! [[String: Any]]).reduce(0) { $0 + ($1["token_ids"] as! [Int]).filter { $0 != 3 }.count }
        })
        XCTAssertEqual(t.audioSeconds, report.clips.prefix(3).reduce(0) { $0 + $1.audioSeconds! }, accuracy: 1e-9)
        XCTAssertGreaterThan(t.rtfx ?? 0, 0)
        XCTAssertGreaterThan(t.tokensPerSecond ?? 0, 0)
        XCTAssertGreaterThan(t.msPerDecoderCall ?? 0, 0)

        // memory: sampled after each clip; on Linux the interpreter child's peak apart
        XCTAssertGreaterThan(report.memory.peakMB ?? 0, 0)
        XCTAssertNotNil(report.clips[0].memoryMB)
        #if os(Linux)
        XCTAssertEqual(report.memory.measure, "VmHWM")
        XCTAssertFalse(report.memory.includesInterpreterChild)
        XCTAssertGreaterThan(report.memory.interpreterChildPeakMB ?? 0, report.memory.peakMB ?? .infinity)
        #endif

        // the JSON `cohere-coreml bench --merge-engine` reads
        let json = try JSONSerialization.jsonObject(with: try report.json()) as! [String: Any]
        XCTAssertEqual(json["tool"] as? String, "cohere-transcribe-swift bench")
        XCTAssertEqual(json["placement"] as? String, "unavailable")
        XCTAssertEqual((json["dataset"] as! [String: Any])["manifest_sha256"] as? String, python["sha256"] as? String)
        XCTAssertEqual((json["bundle"] as! [String: Any])["eos_token_ids"] as? [Int], [3])
        let first = (json["clips"] as! [[String: Any]])[0]
        XCTAssertEqual(first["token_ids"] as? [[Int]], report.clips[0].tokenIds)
        XCTAssertEqual(first["index"] as? Int, 0)
        XCTAssertNotNil(((first["windows"] as! [[String: Any]])[0])["decode_s"] as? Double)
    }

    /// The command line: usage errors exit 2 naming the problem; a run with a failed clip exits 1 and still
    /// prints the JSON of every clip; --max-clips and a forced --language are applied.
    func testCommandLine() throws {
        #if os(macOS) || os(Linux)
        let (dir, _) = try makeDataset()
        let exe = try Fixtures.swiftCLI()
        func run(_ args: [String]) throws -> (Int32, Data, String) {
            let process = Process()
            process.executableURL = exe
            process.arguments = args
            let out = Pipe(), err = Pipe()
            (process.standardOutput, process.standardError) = (out, err)
            try process.run()
            let data = out.fileHandleForReading.readDataToEndOfFile()
            let message = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            process.waitUntilExit()
            return (process.terminationStatus, data, message)
        }
        var (status, out, err) = try run(["bench", "--help"])
        XCTAssertEqual(status, 0)
        XCTAssertTrue(String(decoding: out, as: UTF8.self).contains("--merge-engine"))
        (status, _, err) = try run(["bench", "--bundle", Fixtures.bundle.path])
        XCTAssertEqual(status, 2)
        XCTAssertTrue(err.contains("--data is required"), err)
        (status, _, err) = try run(["bench", "--bundle", Fixtures.bundle.path, "--data", dir.path, "--max-clips", "0"])
        XCTAssertEqual(status, 2)
        XCTAssertTrue(err.contains("--max-clips needs a positive integer"), err)
        (status, _, err) = try run(["bench", "--bundle", Fixtures.bundle.path, "--data", dir.path, "--language", "en",
                                    "--language-from-manifest"])
        XCTAssertEqual(status, 2)
        XCTAssertTrue(err.contains("exclude each other"), err)
        (status, _, err) = try run(["bench", "--bundle", Fixtures.bundle.path, "--data", "/nonexistent-dataset",
                                    "--interpreter", Fixtures.repoRoot.appendingPathComponent(".venv/bin/cohere-coreml").path])
        XCTAssertEqual(status, 2)
        XCTAssertTrue(err.contains("dataset folder not found: /nonexistent-dataset"), err)
        (status, _, err) = try run(["bench", "--bundle", Fixtures.bundle.path, "--data", dir.path, "--vad", "maybe"])
        XCTAssertEqual(status, 2)
        XCTAssertEqual(err, "cohere-transcribe-swift bench: error: --vad must be auto, on or off, got 'maybe'\n")
        // --vad on with a bundle without vad.mlpackage: one line naming the export, before the runtime starts
        let noVAD = try VADManifestTests.bundleWithoutVAD()
        (status, _, err) = try run(["bench", "--bundle", noVAD.path, "--data", dir.path, "--vad", "on",
                                    "--runtime", "interpreter", "--interpreter", "/nonexistent/cohere-coreml"])
        XCTAssertEqual(status, 2)
        XCTAssertEqual(err, "cohere-transcribe-swift bench: error: bundle \(noVAD.path) has no vad.mlpackage: re-export "
                       + "with `cohere-coreml export --vad` (the default)\n")

        // a manifest whose first entry is missing: exit 1, the JSON of both clips run on stdout
        var manifest = try JSONSerialization.jsonObject(with: Data(contentsOf: dir.appendingPathComponent("manifest.json")))
            as! [String: Any]
        var entries = manifest["utterances"] as! [[String: Any]]
        entries.insert(entries.removeLast(), at: 0)
        manifest["utterances"] = entries
        try JSONSerialization.data(withJSONObject: manifest).write(to: dir.appendingPathComponent("manifest.json"))
        (status, out, err) = try run(["bench", "--bundle", Fixtures.bundle.path, "--data", dir.path, "--max-clips", "2",
                                      "--language", "en", "--quiet", "--runtime", "interpreter",
                                      "--interpreter", Fixtures.repoRoot.appendingPathComponent(".venv/bin/cohere-coreml").path])
        XCTAssertEqual(status, 1, err)
        XCTAssertTrue(err.contains("clip gone.wav: audio file not found"), err)
        let json = try JSONSerialization.jsonObject(with: out) as! [String: Any]
        let clips = json["clips"] as! [[String: Any]]
        XCTAssertEqual(clips.map { $0["status"] as! String }, ["problem", "ok"])
        XCTAssertEqual(clips[1]["prompt_language"] as? String, "en")
        XCTAssertEqual((json["dataset"] as! [String: Any])["benched_clips"] as? Int, 2)
        XCTAssertEqual((json["options"] as! [String: Any])["language_from_manifest"] as? Bool, false)
        XCTAssertEqual((json["options"] as! [String: Any])["vad"] as? String, "auto")  // the default, recorded
        #else
        throw XCTSkip("the command line \(Fixtures.noChildProcesses)")
        #endif
    }

    // MARK: - the device decides (candidate sweep, device-choice.json)

    /// The fixture bundle's manifest sha256 and its one layout's id.
    func bundleIdentity() throws -> (sha: String, layout: String) {
        let sha = try SHA256.hexDigest(ofFile: Fixtures.bundle.appendingPathComponent("manifest.json"))
        let layouts = try BundleLayout.layouts(bundle: Fixtures.bundle)
        XCTAssertEqual(layouts.map(\.id), ["decoder.state_writes=host,encoder.parts=whole"])  // the default export
        return (sha, layouts[0].id)
    }

    /// The sweep through the command line (`bench --runtime coreml`: the Core ML code path over the emulation), three
    /// candidates with a fault injected into two children at their first prediction: cpu_and_ne killed by SIGKILL (as
    /// a failed Neural Engine compile does, coremltools issue 2758), cpu_and_gpu exiting with status 3. The parent records
    /// both and completes; cpu_only is chosen, its tokens are the Python CLI's; CohereTranscriber given the
    /// device-choice.json loads every function in cpu_only (and without it, in the default units).
    func testSweepRecordsCrashedChildrenAndTheTranscriberUsesTheChoice() async throws {
        #if os(macOS) || os(Linux)
        let (dir, picked) = try makeDataset()
        let exe = try Fixtures.swiftCLI()
        let (sha, layout) = try bundleIdentity()
        let work = Fixtures.scratch.appendingPathComponent("sweep-\(UUID().uuidString)")
        let choiceURL = work.appendingPathComponent("device-choice.json")
        let process = Process()
        process.executableURL = exe
        process.arguments = ["bench", "--bundle", Fixtures.bundle.path, "--data", dir.path, "--vad", "off", "--runtime", "coreml",
                             "--interpreter", Fixtures.repoRoot.appendingPathComponent(".venv/bin/cohere-coreml").path,
                             "--cache-dir", work.appendingPathComponent("cache").path, "--max-clips", "1", "--no-warmup",
                             "--candidates", "cpu_and_ne,cpu_only,cpu_and_gpu", "--device-choice", choiceURL.path,
                             "--out", work.appendingPathComponent("chosen.json").path]
        var environment = ProcessInfo.processInfo.environment
        environment[FaultInjection.environmentVariable] = "cpu_and_ne:sigkill;cpu_and_gpu:exit"
        process.environment = environment
        let err = Pipe()
        process.standardError = err
        process.standardOutput = Pipe()
        try process.run()
        let message = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        XCTAssertEqual(process.terminationReason, .exit, message)
        XCTAssertEqual(process.terminationStatus, 0, message)
        XCTAssertTrue(message.contains("candidate cpu_and_ne@\(layout): crashed: the child died of SIGKILL"), message)

        let doc = try JSONSerialization.jsonObject(with: Data(contentsOf: choiceURL)) as! [String: Any]
        XCTAssertEqual(doc["kind"] as? String, "device-choice")
        XCTAssertEqual(doc["format_version"] as? Int, 1)
        XCTAssertEqual((doc["bundle"] as! [String: Any])["manifest_sha256"] as? String, sha)
        let candidates = doc["candidates"] as! [[String: Any]]
        // run in unitsOrder whatever order --candidates gives
        XCTAssertEqual(candidates.map { $0["id"] as! String }, ["cpu_only", "cpu_and_gpu", "cpu_and_ne"].map { "\($0)@\(layout)" })
        XCTAssertEqual(candidates.map { $0["status"] as! String }, ["completed", "failed", "crashed"])
        let terminations = candidates.map { $0["termination"] as! [String: Any] }
        XCTAssertEqual(terminations.map { $0["reason"] as! String }, ["exit", "exit", "signal"])
        XCTAssertEqual(terminations[1]["exit_status"] as? Int, 3)
        XCTAssertEqual(terminations[2]["signal"] as? Int, Int(SIGKILL))
        XCTAssertEqual(terminations[2]["signal_name"] as? String, "SIGKILL")
        XCTAssertTrue(candidates[1]["report_file"] is NSNull)
        XCTAssertTrue(candidates[2]["report_file"] is NSNull)
        XCTAssertEqual(candidates.map { $0["eligible"] as! Bool }, [true, false, false])
        XCTAssertEqual(candidates[0]["tokens_match_reference"] as? Bool, true)
        XCTAssertEqual(doc["reference"] as? String, "cpu_only@\(layout)")
        // the completed candidate's figures: cold / warm load, per-stage times, placement (unavailable on Linux)
        let figures = candidates[0]["figures"] as! [String: Any]
        for key in ["load_cold_s", "load_warm_s", "processing_s", "ms_per_decoder_call"] {
            XCTAssertGreaterThan(figures[key] as? Double ?? 0, 0, key)
        }
        XCTAssertEqual(Set((figures["stages_s"] as! [String: Double]).keys), ["features_s", "encoder_s", "prompt_s", "decode_s"])
        XCTAssertEqual(candidates[0]["placement"] as? String, "unavailable")
        #if os(Linux)
        XCTAssertTrue((candidates[0]["placement_reason"] as? String)?.contains("not available on Linux") == true)
        #endif

        // the choice, and its report: the bench JSON of that child, tokens equal to the Python CLI's
        let chosen = doc["chosen"] as! [String: Any]
        XCTAssertEqual(chosen["candidate"] as? String, "cpu_only@\(layout)")
        XCTAssertEqual(chosen["compute_units"] as? [String: String],
                       ["front_end": "cpu_only", "encoder": "cpu_only", "decoder": "cpu_only"])
        let report = try JSONSerialization.jsonObject(with: Data(contentsOf: work.appendingPathComponent(chosen["report_file"] as! String)))
            as! [String: Any]
        XCTAssertEqual(try Data(contentsOf: work.appendingPathComponent("chosen.json")),
                       try Data(contentsOf: work.appendingPathComponent(chosen["report_file"] as! String)))
        XCTAssertEqual(report["runtime"] as? String, "coreml")
        XCTAssertEqual((report["candidate"] as? [String: Any])?["id"] as? String, "cpu_only@\(layout)")
        XCTAssertEqual((report["compute_units"] as? [String: Any])?["encoder"] as? String, "cpu_only")
        let clip = (report["clips"] as! [[String: Any]])[0]
        XCTAssertEqual(clip["token_ids"] as? [[Int]], (picked[0]["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] })

        // CohereTranscriber reads it: every function loads in the chosen units; without it, today's defaults
        let recorder = RecordingRuntime(base: try Fixtures.interpreter())
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: recorder, deviceChoice: .file(choiceURL))
        try await transcriber.prewarm()
        XCTAssertEqual(transcriber.deviceChoice.applied, true, transcriber.deviceChoice.warning ?? "")
        XCTAssertEqual(transcriber.deviceChoice.candidate, "cpu_only@\(layout)")
        XCTAssertEqual(transcriber.deviceChoice.layout?.id, layout)
        XCTAssertEqual(Set(recorder.units.values), [.cpuOnly])
        XCTAssertEqual(Set(recorder.units.keys.map { $0.components(separatedBy: "/")[0] }),
                       Set(["frontend.mlpackage", "encoder.mlpackage", "decoder.mlpackage"]
                           + (transcriber.manifest.files.vad.map { [$0] } ?? [])))  // the VAD where the front end runs
        let plain = RecordingRuntime(base: try Fixtures.interpreter())
        _ = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: plain, deviceChoice: .none)
        XCTAssertEqual(Set(plain.units.values), [.cpuAndNeuralEngine])  // decoder + full-window encoder at init
        // an explicit computeUnits wins over the file
        let explicit = RecordingRuntime(base: try Fixtures.interpreter())
        let t3 = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: explicit, computeUnits: .uniform(.cpuAndGPU),
                                             deviceChoice: .file(choiceURL))
        XCTAssertEqual(Set(explicit.units.values), [.cpuAndGPU])
        XCTAssertEqual(t3.deviceChoice.applied, false)
        #else
        throw XCTSkip("the candidate sweep \(Fixtures.noChildProcesses)")
        #endif
    }

    /// A device-choice.json written by hand from the documented schema (docs/swift.md).
    func choiceDocument(sha: String, layout: String, units: String = "cpu_and_gpu",
                        device: String? = nil) -> [String: Any] {
        let u = ["front_end": units, "encoder": units, "decoder": units]
        return ["kind": "device-choice", "format_version": 1, "tool": "cohere-transcribe-swift bench",
                "machine": ["device": device ?? DeviceBenchmark.MachineRecord.current().device],
                "bundle": ["dir": Fixtures.bundle.path, "manifest_sha256": sha],
                "chosen": ["candidate": "\(units)@\(layout)", "compute_units": u, "layout": ["id": layout]],
                "candidates": [] as [Any]]
    }

    /// device-choice.json read back: a valid file changes the units the transcriber loads with (also found inside the
    /// bundle folder with `.automatic`); a malformed one (not JSON, unknown units, no choice, another bundle, another
    /// device, missing) falls back to today's defaults with a warning naming the problem; one naming a layout the bundle
    /// lacks is refused.
    func testDeviceChoiceFileReadBackAndFallbacks() async throws {
        _ = try Fixtures.require()
        let (sha, layout) = try bundleIdentity()
        let dir = Fixtures.scratch.appendingPathComponent("choice-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        func write(_ object: Any, _ name: String) throws -> URL {
            let url = dir.appendingPathComponent(name)
            try JSONSerialization.data(withJSONObject: object).write(to: url)
            return url
        }
        func transcriber(_ source: DeviceChoice.Source, bundle: URL = Fixtures.bundle) async throws
            -> (CohereTranscriber, RecordingRuntime) {
            let recorder = RecordingRuntime(base: try Fixtures.interpreter())
            return (try await CohereTranscriber(bundle: bundle, runtime: recorder, deviceChoice: source), recorder)
        }

        let good = try write(choiceDocument(sha: sha, layout: layout), "good.json")
        var (t, r) = try await transcriber(.file(good))
        XCTAssertTrue(t.deviceChoice.applied)
        XCTAssertNil(t.deviceChoice.warning)
        XCTAssertEqual(Set(r.units.values), [.cpuAndGPU])

        // malformed: today's defaults (decoder and encoder on cpu_and_ne), the warning names the problem
        let notJSON = dir.appendingPathComponent("broken.json")
        try Data("{\"kind\": \"device-choice\", ".utf8).write(to: notJSON)
        (t, r) = try await transcriber(.file(notJSON))
        XCTAssertFalse(t.deviceChoice.applied)
        XCTAssertEqual(t.deviceChoice.file, notJSON)
        XCTAssertTrue(t.deviceChoice.warning?.contains("broken.json: not a JSON object") == true, t.deviceChoice.warning ?? "-")
        XCTAssertEqual(Set(r.units.values), [.cpuAndNeuralEngine])
        let frontEnd = await t.computeUnits.frontEnd
        XCTAssertEqual(frontEnd, .cpuAndGPU)

        var badUnits = choiceDocument(sha: sha, layout: layout)
        var chosen = badUnits["chosen"] as! [String: Any]
        chosen["compute_units"] = ["front_end": "cpu_only", "encoder": "gpu_only", "decoder": "cpu_only"]
        badUnits["chosen"] = chosen
        (t, r) = try await transcriber(.file(try write(badUnits, "units.json")))
        XCTAssertFalse(t.deviceChoice.applied)
        XCTAssertTrue(t.deviceChoice.warning?.contains("chosen.compute_units.encoder: 'gpu_only' is not one of") == true,
                      t.deviceChoice.warning ?? "-")
        XCTAssertEqual(Set(r.units.values), [.cpuAndNeuralEngine])

        // the rest through the resolver alone (what init calls): each falls back, naming why
        var none = choiceDocument(sha: sha, layout: layout)
        none["chosen"] = NSNull()
        let cases: [(URL, String)] = [
            (try write(none, "none.json"), "chose no candidate"),
            (try write(choiceDocument(sha: String(repeating: "0", count: 64), layout: layout), "other.json"),
             "measured on another bundle"),
            (try write(choiceDocument(sha: sha, layout: layout, device: "iPhone99,9"), "device.json"),
             "measured on iPhone99,9"),
            (try write(["kind": "device-choice", "format_version": 2], "version.json"), "format_version: 2 is not 1"),
            (dir.appendingPathComponent("missing.json"), "missing.json: cannot read it"),
        ]
        for (url, why) in cases {
            let (units, applied) = try DeviceChoice.resolve(.file(url), bundle: Fixtures.bundle)
            XCTAssertNil(units, url.lastPathComponent)
            XCTAssertFalse(applied.applied)
            XCTAssertTrue(applied.warning?.contains(why) == true, "\(url.lastPathComponent): \(applied.warning ?? "-")")
        }
        // no file at all with .automatic: defaults, no warning
        let (units, applied) = try DeviceChoice.resolve(.automatic, bundle: Fixtures.bundle)
        if !FileManager.default.fileExists(atPath: try DeviceChoice.defaultLocation(bundle: Fixtures.bundle).path) {
            XCTAssertNil(units)
            XCTAssertNil(applied.file)
            XCTAssertNil(applied.warning)
        }

        // a layout the bundle does not hold: refused, naming it and the bundle's
        let foreign = try write(choiceDocument(sha: sha, layout: "decoder.state_writes=graph,encoder.parts=whole"), "layout.json")
        do {
            _ = try await transcriber(.file(foreign))
            XCTFail("a device choice naming a layout the bundle lacks was accepted")
        } catch {
            XCTAssertTrue("\(error)".contains("chose layout 'decoder.state_writes=graph,encoder.parts=whole'"), "\(error)")
            XCTAssertTrue("\(error)".contains("it holds: \(layout)"), "\(error)")
        }

        // .automatic finds <bundle>/device-choice.json (a copy of the bundle: the fixture stays as exported)
        let copy = dir.appendingPathComponent("bundle")
        try FileManager.default.copyItem(at: Fixtures.bundle, to: copy)
        try JSONSerialization.data(withJSONObject: choiceDocument(sha: sha, layout: layout, units: "cpu_only"))
            .write(to: copy.appendingPathComponent(DeviceChoice.fileName))
        if !FileManager.default.fileExists(atPath: try DeviceChoice.defaultLocation(bundle: copy).path) {
            (t, r) = try await transcriber(.automatic, bundle: copy)
            XCTAssertTrue(t.deviceChoice.applied, t.deviceChoice.warning ?? "")
            XCTAssertEqual(t.deviceChoice.file?.lastPathComponent, DeviceChoice.fileName)
            XCTAssertEqual(Set(r.units.values), [.cpuOnly])
        }
    }

    /// The selection rule on outcomes: the fastest completed candidate with the reference's tokens; a faster one with
    /// other tokens, or one that did not complete, is not chosen; without a cpu_only run the majority's tokens are the
    /// reference.
    func testSelectionRule() {
        typealias O = DeviceChoice.Outcome
        let right: [Int: DeviceChoice.ClipTokens] = [0: .init(status: "ok", tokenIds: [[5, 6, 3]]), 1: .init(status: "problem", tokenIds: nil)]
        var wrong = right
        wrong[0] = .init(status: "ok", tokenIds: [[5, 7, 3]])
        let outcomes = [
            O(id: "cpu", computeUnits: .cpuOnly, completed: true, processingSeconds: 3, clips: right),
            O(id: "gpu", computeUnits: .cpuAndGPU, completed: true, processingSeconds: 2, clips: right),
            O(id: "ne", computeUnits: .cpuAndNeuralEngine, completed: true, processingSeconds: 1, clips: wrong),
            O(id: "all", computeUnits: .all, completed: false, processingSeconds: nil, clips: [:]),
        ]
        var s = DeviceChoice.select(outcomes)
        XCTAssertEqual(s.reference, "cpu")
        XCTAssertEqual(s.chosen, "gpu")
        XCTAssertEqual(s.matchesReference, ["cpu": true, "gpu": true, "ne": false])
        XCTAssertEqual(s.mismatchedClips["ne"], [0])
        // no cpu_only: the tokens two candidates agree on are the reference, the faster wrong one still loses
        s = DeviceChoice.select(Array(outcomes.dropFirst()) + [O(id: "all2", computeUnits: .all, completed: true,
                                                                 processingSeconds: 2.5, clips: right)])
        XCTAssertEqual(s.reference, "gpu")
        XCTAssertEqual(s.chosen, "gpu")
        // the wrong tokens as the reference (cpu_only itself wrong): the fast wrong candidate wins, so the rule is
        // what decides, not the timings alone
        s = DeviceChoice.select([O(id: "cpu", computeUnits: .cpuOnly, completed: true, processingSeconds: 3, clips: wrong)]
                                + outcomes.dropFirst())
        XCTAssertEqual(s.chosen, "ne")
        XCTAssertNil(DeviceChoice.select([outcomes[3]]).chosen)
    }
}

/// Records the compute units of every function a transcriber loads ("package/function" -> units).
final class RecordingRuntime: ModelRuntime, @unchecked Sendable {
    let base: ModelRuntime
    private let lock = NSLock()
    private var loaded: [String: ComputeUnits] = [:]
    var name: String { base.name }
    var units: [String: ComputeUnits] { lock.lock(); defer { lock.unlock() }; return loaded }

    init(base: ModelRuntime) { self.base = base }

    private func record(_ key: String, _ units: ComputeUnits) {
        lock.lock(); defer { lock.unlock() }
        loaded[key] = units
    }

    func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        record("\(package.lastPathComponent)/\(functionName ?? "main")", computeUnits)
        return try await base.loadModel(at: package, functionName: functionName, computeUnits: computeUnits)
    }
}
