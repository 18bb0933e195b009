@testable import CohereTranscribe
import Foundation
import XCTest
#if canImport(Glibc)
import Glibc
#endif

/// `CoreMLRuntime` itself, run on Linux through the Core ML emulation: strided outputs, the compiled-model
/// cache (stable names, one compile per package, nothing written into the bundle), concurrency, the CLI.
final class CoreMLRuntimeTests: XCTestCase {
    func clips() throws -> [[String: Any]] {
        (try Fixtures.json("transcripts_package.json") as! [String: Any])["clips"] as! [[String: Any]]
    }

    func temporaryFolder(_ tag: String) -> URL {
        Fixtures.scratch.appendingPathComponent("cohere-swift-\(tag)-\(UUID().uuidString)", isDirectory: true)
    }

    // MARK: strides

    /// A padded (non-contiguous) array is read through its strides; reading it as dense bytes (the bug
    /// this guards against) gives other values, so the fixture can tell the two apart.
    func testPaddedArraysAreReadThroughTheirStrides() throws {
        let values = (0..<(3 * 5 * 7)).map { Float($0) * 0.5 - 3 }
        let dense = try Tensor(float32: values, shape: [3, 5, 7])
        let array = try CoreMLModel.multiArray(dense)
        XCTAssertEqual(array.strides.map(\.intValue), [35, 7, 1])  // inputs: C-contiguous, as MLMultiArray(shape:dataType:)
        XCTAssertEqual(try CoreMLModel.tensor(array), dense)
        #if os(Linux)
        let padded = MLMultiArray.padded(dense)
        let strides = padded.strides.map(\.intValue)
        XCTAssertNotEqual(strides, [35, 7, 1])
        XCTAssertGreaterThan(strides[1], 7)  // every row padded
        XCTAssertEqual(try CoreMLModel.tensor(padded), dense)
        let naive = padded.withUnsafeBytes { Data($0.prefix(dense.data.count)) }
        XCTAssertNotEqual(naive, dense.data)  // ignoring the strides would read padding
        // float16 and int32 too
        let half = try Tensor(dtype: .float16, shape: [2, 3], data: Data((0..<12).map { UInt8($0) }))
        XCTAssertEqual(try CoreMLModel.tensor(MLMultiArray.padded(half)), half)
        let ints = try Tensor(int32: [1, 2, 3, 4, 5, 6], shape: [6])
        XCTAssertEqual(try CoreMLModel.tensor(MLMultiArray.padded(ints)), ints)
        #endif
    }

    /// Real package outputs come back padded from the emulation, and the transcriber still reads them
    /// right (the whole-file test runs every clip through CoreMLRuntime).
    func testEmulatedPackageOutputsArePadded() async throws {
        #if os(Linux)
        let runtime = try Fixtures.coreML()
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        let compiled = try await runtime.compiledModel(for: Fixtures.bundle.appendingPathComponent(manifest.files.encoder))
        let configuration = MLModelConfiguration()
        configuration.functionName = "window_10s"
        let model = try await MLModel.load(contentsOf: compiled, configuration: configuration)
        let frames = manifest.encoderBuckets[0].frames
        let features = try CoreMLModel.multiArray(try Tensor(float32: [Float](repeating: 0.1, count: manifest.encoder.numMelBins * frames),
                                                             shape: [1, manifest.encoder.numMelBins, frames]))
        var inputs: [String: MLMultiArray] = ["input_features": features]
        for (name, mask) in try manifest.encoder.lengthMasks.tensors(validFrames: frames, frames: frames) {
            inputs[name] = try CoreMLModel.multiArray(mask)
        }
        let out = try await model.prediction(from: try MLDictionaryFeatureProvider(dictionary: inputs),
                                             options: MLPredictionOptions())
        let k = try XCTUnwrap(out.featureValue(for: "cross_k")?.multiArrayValue)
        let shape = k.shape.map(\.intValue)
        XCTAssertNotEqual(k.strides.map(\.intValue)[shape.count - 2], shape.last!)  // rows padded
        XCTAssertEqual(try CoreMLModel.tensor(k).shape, shape)
        #else
        throw XCTSkip("the emulation's padding is Linux-only")
        #endif
    }

    // MARK: compiled-model cache

    /// The cache names Python's Core ML backend gives the bundle's packages (runtime/compiled_cache.py,
    /// the same rule): the Swift runtime names each compiled model exactly so.
    func testCacheNamesEqualThePythonBackends() throws {
        let names = try XCTUnwrap(Fixtures.json("compiled_names.json") as? [String: String])
        XCTAssertGreaterThanOrEqual(names.count, 3)
        let runtime = try CoreMLRuntime(cacheDirectory: temporaryFolder("names"))
        for (package, name) in names {
            XCTAssertEqual(try runtime.cachedLocation(for: Fixtures.bundle.appendingPathComponent(package)).lastPathComponent,
                           name, package)
        }
    }

    /// The cache name is a sha256 of the package's content, the same in every process: from the
    /// manifest's checksums, and it changes when a checksum does; without checksums, from the file table.
    func testCacheNamesAreStableContentDigests() throws {
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        let encoder = Fixtures.bundle.appendingPathComponent(manifest.files.encoder)
        let digest = try CoreMLRuntime.digest(of: encoder)
        XCTAssertEqual(digest.count, 64)
        XCTAssertEqual(try CoreMLRuntime.digest(of: encoder), digest)
        XCTAssertNotEqual(try CoreMLRuntime.digest(of: Fixtures.bundle.appendingPathComponent(manifest.files.decoder)), digest)
        // the same package beside an edited manifest: another digest; beside none: the file table's
        let copy = temporaryFolder("digest")
        try FileManager.default.createDirectory(at: copy, withIntermediateDirectories: true)
        let package = copy.appendingPathComponent(encoder.lastPathComponent)
        try FileManager.default.copyItem(at: encoder, to: package)
        XCTAssertNotEqual(try CoreMLRuntime.digest(of: package), digest)  // no manifest: file table (other mtimes)
        var json = try JSONSerialization.jsonObject(with: Data(contentsOf: Fixtures.bundle.appendingPathComponent("manifest.json"))) as! [String: Any]
        if var checksums = json["checksums"] as? [String: Any], var files = checksums["files"] as? [String: [String: Any]] {
            try JSONSerialization.data(withJSONObject: json).write(to: copy.appendingPathComponent("manifest.json"))
            XCTAssertEqual(try CoreMLRuntime.digest(of: package), digest)  // same checksums: same name
            let key = files.keys.sorted().first { $0.hasPrefix(encoder.lastPathComponent + "/") }!
            files[key]!["sha256"] = String(repeating: "0", count: 64)
            checksums["files"] = files
            json["checksums"] = checksums
            try JSONSerialization.data(withJSONObject: json).write(to: copy.appendingPathComponent("manifest.json"))
            XCTAssertNotEqual(try CoreMLRuntime.digest(of: package), digest)
        } else {
            XCTFail("the fixture bundle's manifest has no checksums")
        }
    }

    /// The first load compiles each package once (concurrent callers share the compile), the compiled
    /// models land in the cache folder, never in or beside the bundle, and the temporary compile
    /// result is moved, not left behind.
    func testConcurrentLoadsCompileEachPackageOnceIntoTheCache() async throws {
        let cache = temporaryFolder("cache")
        let runtime = try Fixtures.coreML(cacheDirectory: cache)
        #if os(Linux)
        let compilesBefore = CoreMLEmulation.statistics.compiles
        #endif
        let before = try FileManager.default.contentsOfDirectory(atPath: Fixtures.bundle.path).sorted()
        let parentBefore = try FileManager.default.contentsOfDirectory(atPath: Fixtures.bundle.deletingLastPathComponent().path).sorted()
        let transcriber = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime)
        let clip = try clips().first { ($0["group"] as? String) == "heldout" }!
        async let warmed: Void = transcriber.prewarm()
        async let result = transcriber.transcribe(contentsOf: URL(fileURLWithPath: clip["wav"] as! String),
                                                  language: clip["language"] as! String, vad: .off)
        try await warmed
        let r = try await result
        XCTAssertEqual(r.tokenIds, (clip["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] })
        let manifest = transcriber.manifest
        let packages = Set([manifest.files.encoder, manifest.files.decoder, manifest.files.frontend, manifest.files.vad]
            .compactMap { $0 })
        XCTAssertEqual(runtime.cacheStatistics.compiled, packages.count)  // one compile per package, not per function or caller
        #if os(Linux)
        XCTAssertEqual(CoreMLEmulation.statistics.compiles - compilesBefore, packages.count)  // MLModel.compileModel calls
        #endif
        let cached = try FileManager.default.contentsOfDirectory(atPath: cache.path).filter { !$0.hasPrefix(".") }.sorted()
        XCTAssertEqual(cached.count, packages.count)
        for name in cached {
            XCTAssertTrue(name.hasSuffix(".mlmodelc"), name)
            XCTAssertTrue(FileManager.default.fileExists(atPath: cache.appendingPathComponent(name).appendingPathComponent(".complete").path))
        }
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: Fixtures.bundle.path).sorted(), before)
        XCTAssertEqual(try FileManager.default.contentsOfDirectory(atPath: Fixtures.bundle.deletingLastPathComponent().path).sorted(),
                       parentBefore)  // no .compiled/ beside the bundle either
        #if os(Linux)
        let leftovers = FileManager.default.enumerator(atPath: CoreMLEmulation.temporaryRoot.path)?
            .compactMap { $0 as? String }.filter { $0.hasSuffix(".mlmodelc") } ?? []
        XCTAssertEqual(leftovers, [])  // the temporary compile results were moved into the cache
        #endif
        // a second runtime on the same cache (a later launch in this process) compiles nothing
        let again = try Fixtures.coreML(cacheDirectory: cache)
        let second = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: again)
        try await second.prewarm()
        XCTAssertEqual(again.cacheStatistics.compiled, 0)
        XCTAssertEqual(again.cacheStatistics.fromCache, packages.count)
    }

    /// Two functions of one package loaded at the same time (prewarm beside a transcription) share one
    /// compile: the second caller waits for the first instead of compiling again and deleting its result.
    func testSimultaneousLoadsOfOnePackageShareOneCompile() async throws {
        #if os(Linux)
        let runtime = try Fixtures.coreML()
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        let package = Fixtures.bundle.appendingPathComponent(manifest.files.encoder)
        let compilesBefore = CoreMLEmulation.statistics.compiles
        async let a = runtime.loadModel(at: package, functionName: nil, computeUnits: .cpuOnly)
        async let b = runtime.loadModel(at: package, functionName: "window_10s", computeUnits: .cpuOnly)
        async let c = runtime.loadModel(at: package, functionName: "window_10s", computeUnits: .cpuOnly)
        let (ma, mb, mc) = try await (a, b, c)
        XCTAssertEqual(CoreMLEmulation.statistics.compiles - compilesBefore, 1)
        XCTAssertEqual([ma.functionName, mb.functionName, mc.functionName], ["main", "window_10s", "window_10s"])
        XCTAssertEqual(ma.io.inputs["input_features"]?.shape.last, manifest.encoderBuckets.last?.frames)
        #else
        throw XCTSkip("counts the emulation's compiles")
        #endif
    }

    /// An incomplete cache entry (a process killed while installing) is not used: it is recompiled.
    func testIncompleteCacheEntryIsRecompiled() async throws {
        let cache = temporaryFolder("partial")
        let runtime = try Fixtures.coreML(cacheDirectory: cache)
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        let package = Fixtures.bundle.appendingPathComponent(manifest.files.decoder)
        let target = try runtime.cachedLocation(for: package)
        try FileManager.default.createDirectory(at: target, withIntermediateDirectories: true)
        try Data("half".utf8).write(to: target.appendingPathComponent("junk"))
        let url = try await runtime.compiledModel(for: package)
        XCTAssertEqual(url.standardizedFileURL.path, target.standardizedFileURL.path)
        XCTAssertEqual(runtime.cacheStatistics.compiled, 1)
        XCTAssertFalse(FileManager.default.fileExists(atPath: target.appendingPathComponent("junk").path))
    }

    // MARK: decoder calls

    /// What each decoder call binds: a step only its token and position (the cross memory is in the
    /// decoder state; a host-state decoder's step also the fixed-size fp16 cache mask, C x 2 bytes); the
    /// graph-state decoder's bind call the cross memory, once per window (the host-state one has none: the
    /// app writes the memory into the state).
    func testBytesBoundPerDecoderCall() async throws {
        #if os(Linux)
        for url in [Fixtures.bundle, Fixtures.graphBundle] {
            let transcriber = try await CohereTranscriber(bundle: url, runtime: try Fixtures.coreML())
            let manifest = transcriber.manifest
            let clip = try clips().first { ($0["group"] as? String) == "heldout" }!
            _ = try await transcriber.transcribe(contentsOf: URL(fileURLWithPath: clip["wav"] as! String),
                                                 language: clip["language"] as! String, vad: .off)
            let bytes = CoreMLEmulation.statistics.inputBytesByFunction
            let memory = manifest.decoder.memoryShape.reduce(1, *) * 2 * (manifest.precision == "fp32" ? 4 : 2)
                + manifest.encoder.memoryLength * (manifest.precision == "fp32" ? 4 : 2)
            let step = manifest.decoder.functions?.step ?? "main"
            if manifest.decoder.hostWritesState {
                XCTAssertNil(manifest.decoder.functions?.bind)
                XCTAssertEqual(bytes[step], 8 + 2 * manifest.decoder.capacity)  // + cache_mask, fp16 (1, 1, 1, C)
            } else {
                let bind = try XCTUnwrap(manifest.decoder.functions?.bind)
                XCTAssertEqual(bytes[step], 8)  // input_ids + position, int32: nothing that grows with the audio
                XCTAssertEqual(bytes[bind], memory)  // the cross memory, once per window
            }
            if let prefill = manifest.decoder.functions?.prefill, let length = manifest.decoder.prefillLength {
                XCTAssertEqual(bytes[prefill], 4 * length)
            }
        }
        #else
        throw XCTSkip("the emulation's counters are Linux-only")
        #endif
    }

    // MARK: the command line

    /// `cohere-transcribe-swift --runtime coreml` transcribes through `CoreMLRuntime` token for token as the
    /// Python CLI, and a second launch loads every package from the cache without compiling.
    func testCLICoreMLRuntimeEqualsPythonAndLaterLaunchesUseTheCache() throws {
        #if os(macOS) || os(Linux)
        let cli = try Fixtures.swiftCLI()
        let cache = temporaryFolder("cli-cache")
        let all = try clips()
        var launches: [String] = []
        var clipsChecked = 0, multiWindow = 0
        let batch = try XCTUnwrap(try BundleManifest.load(bundle: Fixtures.bundle).decoder.batch?.size)
        for language in ["en", "de", "es"] {  // every demo and held-out clip, one launch per language
            let picked = all.filter { ($0["language"] as! String) == language }
            let process = Process()
            process.executableURL = cli
            process.arguments = ["--bundle", Fixtures.bundle.path, "--language", language, "--json", "--vad", "off", "--runtime", "coreml",
                                 "--cache-dir", cache.path,
                                 "--interpreter", Fixtures.repoRoot.appendingPathComponent(".venv/bin/cohere-coreml").path]
                + picked.map { $0["wav"] as! String }
            let out = Pipe(), err = Pipe()
            process.standardOutput = out
            process.standardError = err
            try process.run()
            let stdout = out.fileHandleForReading.readDataToEndOfFile()
            let stderr = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            process.waitUntilExit()
            XCTAssertEqual(process.terminationStatus, 0, stderr)
            let got = try JSONSerialization.jsonObject(with: stdout)
            let entries = (got as? [[String: Any]]) ?? [got as! [String: Any]]
            XCTAssertEqual(entries.count, picked.count)
            for (entry, clip) in zip(entries, picked) {
                let want = (clip["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] }
                let have = (entry["windows"] as! [[String: Any]]).map { $0["token_ids"] as! [Int] }
                XCTAssertEqual(have, want, "\(language): \(clip["wav"]!)")
                for w in entry["windows"] as! [[String: Any]] {  // a file of several windows: decoded B at a time
                    XCTAssertEqual((w["timings"] as? [String: Any])?["decoder_batch"] as? Int, have.count > 1 ? batch : nil,
                                   "\(language): \(clip["wav"]!)")
                }
                multiWindow += have.count > 1 ? 1 : 0
                clipsChecked += 1
            }
            launches.append(stderr.split(separator: "\n").first { $0.contains("Core ML:") }.map(String.init) ?? stderr)
        }
        XCTAssertEqual(clipsChecked, all.count)
        XCTAssertGreaterThan(multiWindow, 0)
        XCTAssertTrue(launches[0].contains("3 package(s) compiled, 0 loaded compiled"), launches[0])
        for later in launches.dropFirst() {  // later launches: every package from the cache, nothing compiled
            XCTAssertTrue(later.contains("0 package(s) compiled, 3 loaded compiled"), later)
        }
        #else
        throw XCTSkip("the command line \(Fixtures.noChildProcesses)")
        #endif
    }

    // MARK: the interpreter child

    /// A dead `serve-runtime` child gives an error on the next call, not a SIGPIPE that kills the host,
    /// and the host's SIGPIPE disposition is left as it was (no process-wide `signal(SIGPIPE, SIG_IGN)`).
    func testDeadInterpreterChildIsAnErrorAndSIGPIPEIsUntouched() throws {
        #if os(Linux) || os(macOS)
        var before = sigaction()
        sigaction(SIGPIPE, nil, &before)
        let script = temporaryFolder("child").appendingPathExtension("sh")
        try "#!/bin/sh\necho '{\"ok\": true, \"protocol\": \"cohere-coreml-serve-runtime\", \"version\": 1}'\nexec 0<&-\nsleep 1\n"
            .write(to: script, atomically: true, encoding: .utf8)
        chmod(script.path, 0o755)
        let runtime = try InterpreterRuntime(executable: script, arguments: [])
        var after = sigaction()
        sigaction(SIGPIPE, nil, &after)
        #if os(Linux)
        XCTAssertEqual(unsafeBitCast(after.__sigaction_handler.sa_handler, to: Int.self),
                       unsafeBitCast(before.__sigaction_handler.sa_handler, to: Int.self))
        #endif
        let big = try Tensor(float32: [Float](repeating: 1, count: 1 << 20), shape: [1 << 20])
        XCTAssertThrowsError(try runtime.call(["op": "predict", "model": "m1"], arrays: [("x", big)])) {
            XCTAssertTrue("\($0)".contains("interpreter process"), "\($0)")
        }
        #endif
    }

    // MARK: fidelity of the emulation to the SDK

    func testEmulationFollowsTheSDKDeclarations() throws {
        #if os(Linux)
        XCTAssertEqual(MLMultiArrayDataType.float64, .double)  // aliases, not cases
        XCTAssertEqual(MLMultiArrayDataType.float, .float32)
        XCTAssertEqual(MLMultiArrayDataType.double.rawValue, 65600)
        XCTAssertEqual(MLMultiArrayDataType.float32.rawValue, 65568)
        XCTAssertEqual(MLMultiArrayDataType.float16.rawValue, 65552)
        XCTAssertEqual(MLMultiArrayDataType.int32.rawValue, 131104)
        XCTAssertEqual(MLComputeUnits.cpuAndNeuralEngine.rawValue, 3)
        let shape: [Int] = MLStateConstraint(bufferShape: [8, 8, 288, 128], dataType: .float16).bufferShape  // [Int], not [NSNumber]
        XCTAssertEqual(shape, [8, 8, 288, 128])
        // an .mlpackage is not loadable before it is compiled, as on a device
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        CoreMLEmulation.use(try Fixtures.interpreter())
        XCTAssertThrowsError(try MLModel(contentsOf: Fixtures.bundle.appendingPathComponent(manifest.files.decoder),
                                         configuration: MLModelConfiguration())) {
            XCTAssertTrue("\($0.localizedDescription)".contains("not a compiled model"), "\($0)")
        }
        #endif
    }
}
