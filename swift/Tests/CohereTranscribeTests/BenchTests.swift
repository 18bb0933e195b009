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
        let process = Process()
        process.executableURL = Fixtures.repoRoot.appendingPathComponent(".venv/bin/python")
        process.arguments = ["-c", """
            import json, sys
            from cohere_coreml.datasets import load_folder
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
    }

    func testBenchOnHeldOutClipsThroughTheInterpreter() async throws {
        let (dir, picked) = try makeDataset()
        let options = DeviceBenchmark.Options(bundle: Fixtures.bundle, dataset: dir.path)
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
        let (dir, _) = try makeDataset()
        let exe = Fixtures.repoRoot.appendingPathComponent(".build/debug/cohere-transcribe-swift")
        guard FileManager.default.isExecutableFile(atPath: exe.path) else {
            XCTFail("no \(exe.path): build it with `swift build --build-tests`")
            return
        }
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
    }
}
