@testable import CohereTranscribe
import Foundation
import XCTest

final class BundleManifestTests: XCTestCase {
    func manifestJSON() throws -> [String: Any] {
        let data = try Data(contentsOf: try Fixtures.require().appendingPathComponent("bundle/manifest.json"))
        return try JSONSerialization.jsonObject(with: data) as! [String: Any]
    }

    /// A copy of the test bundle whose manifest is `edit`ed (packages copied: a bundle holds no links).
    /// `source`: the test bundle by default; `Fixtures.graphBundle` for the graph-state decoder (bind_memory).
    func editedBundle(from source: URL = Fixtures.bundle, _ edit: (inout [String: Any]) -> Void) throws -> URL {
        var json = try JSONSerialization.jsonObject(with: try Data(contentsOf: source.appendingPathComponent("manifest.json")))
            as! [String: Any]
        edit(&json)
        let dir = Fixtures.scratch.appendingPathComponent("cohere-swift-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        for name in try FileManager.default.contentsOfDirectory(atPath: source.path) where name != "manifest.json" {
            try FileManager.default.copyItem(at: source.appendingPathComponent(name),
                                             to: dir.appendingPathComponent(name))
        }
        try JSONSerialization.data(withJSONObject: json).write(to: dir.appendingPathComponent("manifest.json"))
        return dir
    }

    func testRealExportedManifestDecodes() throws {
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        let json = try manifestJSON()
        let decoder = json["decoder"] as! [String: Any]
        XCTAssertEqual(m.formatVersion, 3)
        // the export's default decoder: host-state (no bind function; the app writes the state)
        XCTAssertEqual(m.decoder.stateWrites, "host")
        XCTAssertNil(m.decoder.functions?.bind)
        XCTAssertEqual(m.decoder.memoryStates, ["cross_k": "cross_k", "cross_v": "cross_v", "cross_mask": "cross_mask"])
        XCTAssertEqual(m.decoder.rowOutputs, ["self_k": "new_k", "self_v": "new_v"])
        // the step takes no encoder-length input: the cross memory is in its state; the host's cache mask
        let step = try XCTUnwrap(m.listedIO(component: "decoder", function: "main"))
        XCTAssertEqual(Set(step.inputs.keys), ["input_ids", "position", "cache_mask"])
        XCTAssertEqual(step.outputs["new_k"]?.shape, [m.decoder.cacheShape[0], m.decoder.cacheShape[1], 1, m.decoder.cacheShape[3]])
        XCTAssertEqual(Set(step.states.keys), ["self_k", "self_v", "cross_k", "cross_v", "cross_mask"])
        XCTAssertEqual(m.expectedDecoderIO().inputs, step.inputs)
        // the graph-state variant (bundle-graph/): bind_memory takes the encoder's outputs
        let g = try BundleManifest.load(bundle: Fixtures.graphBundle)
        XCTAssertFalse(g.decoder.hostWritesState)
        XCTAssertEqual(g.decoder.functions?.bind, "bind_memory")
        XCTAssertEqual(g.decoder.bindInputs, ["encoder_cross_k": "cross_k", "encoder_cross_v": "cross_v",
                                              "encoder_cross_mask": "cross_mask"])
        XCTAssertEqual(Set(try XCTUnwrap(g.listedIO(component: "decoder", function: "main")).inputs.keys), ["input_ids", "position"])
        XCTAssertEqual(g.listedIO(component: "decoder", function: "bind_memory")?.inputs["encoder_cross_k"]?.shape,
                       g.decoder.memoryShape)
        XCTAssertEqual(m.decoder.capacity, decoder["capacity"] as? Int)
        XCTAssertEqual(m.decoder.cacheShape, decoder["cache_shape"] as? [Int])
        XCTAssertEqual(m.decoder.functions?.prefill, "prefill")
        XCTAssertEqual(m.decoder.prefillLength, 10)
        XCTAssertEqual(m.encoderBuckets.map(\.function), ["window_10s", "main"])
        XCTAssertEqual(m.encoderBuckets.map(\.frames), [1000, 3500])
        XCTAssertEqual(m.tokens.eosTokenIds, [3])
        let en = (json["languages"] as! [String: [String: [Int]]])["en"]!
        XCTAssertEqual(try m.prompt(language: "en"), en["punctuation"])
        XCTAssertEqual(try m.prompt(language: "en", punctuation: false), en["no_punctuation"])
        XCTAssertEqual(m.languages.count, 14)
        // every function's I/O is listed (read from the packages at export)
        for b in m.encoderBuckets {
            let io = try XCTUnwrap(m.listedIO(component: "encoder", function: b.function), b.function)
            XCTAssertEqual(io.inputs["input_features"]?.shape, [1, m.encoder.numMelBins, b.frames])
        }
        XCTAssertEqual(m.listedIO(component: "decoder", function: "prefill")?.inputs["input_ids"]?.shape, [1, 10])
        XCTAssertEqual(m.listedIO(component: "decoder", function: "main")?.inputs["input_ids"]?.shape, [1, 1])
        if let frontend = m.frontend {  // one front-end function per encoder window, same names and frames
            XCTAssertEqual(Set(frontend.functions.keys), Set(m.encoderBuckets.map(\.function)))
            for (name, f) in frontend.functions {
                XCTAssertEqual(m.listedIO(component: "frontend", function: name)?.inputs["audio"]?.shape, [1, f.samples])
                XCTAssertEqual(f.frames, m.encoderBuckets.first { $0.function == name }?.frames)
            }
        }
    }

    /// A manifest naming a file outside the bundle, or a bundle whose package is a symbolic link (to a
    /// folder outside it), is refused before anything is read, naming the path.
    func testPathsLeavingTheBundleAndSymbolicLinksAreRefused() async throws {
        for bad in ["../encoder.mlpackage", "/etc/passwd", "a//b", "./vocab.json", "C:/x", "dir\\\\v.json"] {
            let dir = try editedBundle { json in
                var files = json["files"] as! [String: Any]
                files["vocab"] = bad
                json["files"] = files
            }
            XCTAssertThrowsError(try BundleManifest.load(bundle: dir), bad) { error in
                guard case BundleError.unsafePath(let message) = error else { return XCTFail("\(bad): \(error)") }
                XCTAssertTrue(message.contains("files.vocab"), message)
            }
        }
        let dir = try editedBundle { _ in }
        let manifest = try BundleManifest.load(bundle: dir)
        let decoder = dir.appendingPathComponent(manifest.files.decoder)
        let outside = Fixtures.scratch.appendingPathComponent("outside-\(UUID().uuidString).mlpackage")
        try FileManager.default.moveItem(at: decoder, to: outside)
        try FileManager.default.createSymbolicLink(at: decoder, withDestinationURL: outside)
        do {
            _ = try await CohereTranscriber(bundle: dir, runtime: try Fixtures.interpreter())
            XCTFail("a symbolic link inside the bundle was followed")
        } catch BundleError.unsafePath(let message) {
            XCTAssertTrue(message.contains("decoder.mlpackage") && message.contains("symbolic link"), message)
        }
        // the same files as regular files load (the refusal was the link)
        try FileManager.default.removeItem(at: decoder)
        try FileManager.default.moveItem(at: outside, to: decoder)
        let loaded = try await CohereTranscriber(bundle: dir, runtime: try Fixtures.interpreter())
        XCTAssertEqual(loaded.manifest.files.decoder, manifest.files.decoder)
    }

    /// A format-1 bundle (the cross memory an input of every step) and a format-2 one (the encoder computed
    /// its own length masks from feature_length) are refused with the command that re-exports them.
    func testOlderFormatVersionIsRefused() throws {
        for version in [1, 2] {
            let dir = try editedBundle { $0["format_version"] = version }
            XCTAssertThrowsError(try BundleManifest.load(bundle: dir)) { error in
                guard case BundleError.unsupportedFormat(let message) = error else { return XCTFail("\(error)") }
                XCTAssertTrue(message.contains("format_version \(version)") && message.contains("cohere-coreml export --force"), message)
            }
        }
    }

    /// The host's length masks follow transformers' subsampling arithmetic (Python's `shapes.LengthMasks`):
    /// the released x8 subsampling (kernel 3, stride 2, padding 1) turns 3500 mel frames into 438 encoder
    /// frames, odd lengths above 2048 exactly, and a length that a stage floors below zero gives 0 (floor division).
    func testLengthMasksFollowTheSubsamplingArithmetic() throws {
        let released = BundleManifest.LengthMasks(kernelSize: 3, stride: 2, padding: 1, stages: 3)
        XCTAssertEqual(released.names, ["feature_mask", "subsampling_mask_1", "subsampling_mask_2", "encoder_mask"])
        XCTAssertEqual(released.lengths(3500), [3500, 1750, 875, 438])
        XCTAssertEqual(released.lengths(2049), [2049, 1025, 513, 257])
        XCTAssertEqual(BundleManifest.LengthMasks(kernelSize: 5, stride: 2, padding: 1, stages: 1).lengths(1), [1, 0])
        let masks = try released.tensors(validFrames: 9, frames: 20)
        XCTAssertEqual(masks["feature_mask"]?.shape, [1, 20])
        XCTAssertEqual(masks["feature_mask"]?.floats(), [Float](repeating: 1, count: 9) + [Float](repeating: 0, count: 11))
        XCTAssertEqual(masks["encoder_mask"]?.shape, [1, 3])
        XCTAssertEqual(masks["encoder_mask"]?.floats(), [1, 1, 0])  // 9 -> 5 -> 3 -> 2 valid of 20 -> 10 -> 5 -> 3
        XCTAssertEqual(masks["encoder_mask"]?.dtype, .float16)
        XCTAssertThrowsError(try released.tensors(validFrames: 21, frames: 20))
        XCTAssertThrowsError(try released.tensors(validFrames: 0, frames: 20))
    }

    func testNewerFormatVersionIsRefused() throws {
        let newer = BundleManifest.supportedFormatVersion + 1
        let dir = try editedBundle { $0["format_version"] = newer }
        XCTAssertThrowsError(try BundleManifest.load(bundle: dir)) { error in
            XCTAssertEqual(error as? BundleError, .newerFormatVersion(found: newer, supported: BundleManifest.supportedFormatVersion))
            XCTAssertTrue("\(error)".contains("newer"))
        }
    }

    func testOtherFormatsAndMissingFieldsAreNamed() throws {
        XCTAssertThrowsError(try BundleManifest.decode(Data("{\"format\": \"x\", \"format_version\": 1}".utf8))) {
            XCTAssertTrue("\($0)".contains("expected 'cohere-coreml-bundle'"), "\($0)")
        }
        XCTAssertThrowsError(try BundleManifest.decode(Data("not json".utf8))) {
            XCTAssertTrue("\($0)".contains("not JSON"), "\($0)")
        }
        let dir = try editedBundle { json in
            var decoder = json["decoder"] as! [String: Any]
            decoder.removeValue(forKey: "capacity")
            json["decoder"] = decoder
        }
        XCTAssertThrowsError(try BundleManifest.load(bundle: dir)) {
            XCTAssertTrue("\($0)".contains("decoder.capacity"), "\($0)")
        }
        XCTAssertThrowsError(try BundleManifest.load(bundle: URL(fileURLWithPath: "/nonexistent"))) {
            XCTAssertTrue("\($0)".contains("no manifest.json"), "\($0)")
        }
    }

    func testUnknownLanguageListsTheBundlesLanguages() throws {
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        XCTAssertThrowsError(try m.prompt(language: "xx")) { error in
            guard case .unknownLanguage(let lang, let available)? = error as? BundleError else { return XCTFail("\(error)") }
            XCTAssertEqual(lang, "xx")
            XCTAssertTrue(available.contains("en") && available.contains("zh"))
            XCTAssertTrue("\(error)".contains("unsupported language 'xx'"))
        }
    }

    /// A manifest whose shapes do not agree with each other is refused by the loader, naming the field; one
    /// whose io blocks agree with its sizes but not with the packages: the transcriber names the array.
    func testPackageIOMismatchIsNamed() async throws {
        let runtime = try Fixtures.interpreter()
        let dir = try editedBundle { json in
            var decoder = json["decoder"] as! [String: Any]
            var memory = decoder["memory_shape"] as! [Int]
            memory[2] += 32
            decoder["memory_shape"] = memory
            json["decoder"] = decoder
        }
        do {
            _ = try await CohereTranscriber(bundle: dir, runtime: runtime)
            XCTFail("a mismatching manifest was accepted")
        } catch let error as BundleError {
            XCTAssertEqual(error.field, "decoder.memory_shape", "\(error)")
            XCTAssertTrue("\(error)".contains("encoder.memory_len"), "\(error)")
        }
        // a manifest io block that names an output the package lacks (in encoder.io and functions.main.io,
        // which the loader checks equal; an extra input is refused earlier: the manifest names a format-3
        // encoder's inputs exactly)
        let dir2 = try editedBundle { json in
            Self.editIO(&json, "encoder", function: "main") { io in
                var outputs = io["outputs"] as! [String: Any]
                outputs["speaker"] = ["shape": [1], "dtype": "int32"]
                io["outputs"] = outputs
            }
            var encoder = json["encoder"] as! [String: Any]
            encoder["io"] = ((encoder["functions"] as! [String: Any])["main"] as! [String: Any])["io"]
            json["encoder"] = encoder
        }
        do {
            _ = try await CohereTranscriber(bundle: dir2, runtime: runtime)
            XCTFail("a manifest io block naming a missing output was accepted")
        } catch let error as BundleError {
            XCTAssertTrue("\(error)".contains("no output 'speaker'"), "\(error)")
        }
    }

    /// manifest.json["section"]: the io block of `function` (encoder/frontend: functions[f].io; decoder:
    /// io for the step, prefill_io for "prefill", bind_io for "bind_memory"), edited in place.
    static func editIO(_ json: inout [String: Any], _ section: String, function: String, _ edit: (inout [String: Any]) -> Void) {
        var s = json[section] as! [String: Any]
        if section == "decoder" {
            let key = function == "prefill" ? "prefill_io" : function == "bind_memory" ? "bind_io" : "io"
            var io = s[key] as! [String: Any]
            edit(&io)
            s[key] = io
        } else {
            var functions = s["functions"] as! [String: Any]
            var f = functions[function] as! [String: Any]
            var io = f["io"] as! [String: Any]
            edit(&io)
            f["io"] = io
            functions[function] = f
            s["functions"] = functions
            // a whole encoder's one part lists the same io (the manifest checks the two agree)
            if section == "encoder", var parts = s["parts"] as? [[String: Any]], parts.count == 1 {
                var partFunctions = parts[0]["functions"] as! [String: Any]
                partFunctions[function] = ["io": io]
                parts[0]["functions"] = partFunctions
                s["parts"] = parts
            }
        }
        json[section] = s
    }

    /// Every function's io block is checked where it is loaded: the prefill function at init, a length
    /// bucket and the front-end functions at prewarm (or first use).
    func testEveryFunctionIOBlockIsChecked() async throws {
        let runtime = try Fixtures.interpreter()
        // (an io block that disagrees with the manifest's sizes is refused by the loader, naming the field;
        // these agree with them and list an output the package lacks, or lack one it has)
        let prefill = try editedBundle { json in
            Self.editIO(&json, "decoder", function: "prefill") { io in
                var outputs = io["outputs"] as! [String: Any]
                outputs["extra"] = ["shape": [1], "dtype": "int32"]
                io["outputs"] = outputs
            }
        }
        do {
            _ = try await CohereTranscriber(bundle: prefill, runtime: runtime)
            XCTFail("a wrong prefill io block was accepted")
        } catch let error as BundleError {
            guard case .ioMismatch(let component, let function, let detail) = error else { return XCTFail("\(error)") }
            XCTAssertEqual(component, "decoder")
            XCTAssertEqual(function, "prefill")
            XCTAssertTrue(detail.contains("no output 'extra'"), detail)
        }
        let bind = try editedBundle(from: Fixtures.graphBundle) { json in  // the bind function's io block: checked at init too
            Self.editIO(&json, "decoder", function: "bind_memory") { io in
                var outputs = io["outputs"] as! [String: Any]
                outputs["memory_length_2"] = ["shape": [2], "dtype": "int32"]
                io["outputs"] = outputs
            }
        }
        do {
            _ = try await CohereTranscriber(bundle: bind, runtime: runtime)
            XCTFail("a wrong bind_io block was accepted")
        } catch let error as BundleError {
            guard case .ioMismatch(_, let function, let detail) = error else { return XCTFail("\(error)") }
            XCTAssertEqual(function, "bind_memory")
            XCTAssertTrue(detail.contains("no output 'memory_length_2'"), detail)
        }
        var sections = [("encoder", "window_10s")]
        let manifest = try BundleManifest.load(bundle: Fixtures.bundle)
        if let frontend = manifest.frontend { sections += frontend.functions.keys.sorted().map { ("frontend", $0) } }
        for (section, function) in sections {
            // encoder: an output the loader does not require dropped; front end (every output required):
            // one the package lacks added (frontend.io is functions.main.io)
            let dir = try editedBundle { json in
                Self.editIO(&json, section, function: function) { io in
                    var outputs = io["outputs"] as! [String: Any]
                    if section == "encoder" { outputs.removeValue(forKey: "encoder_hidden_states") } else {
                        outputs["extra"] = ["shape": [1], "dtype": "int32"]
                    }
                    io["outputs"] = outputs
                }
                if section == "frontend", function == "main" {
                    var frontend = json["frontend"] as! [String: Any]
                    frontend["io"] = ((frontend["functions"] as! [String: Any])["main"] as! [String: Any])["io"]
                    json["frontend"] = frontend
                }
            }
            let transcriber = try await CohereTranscriber(bundle: dir, runtime: runtime)  // loads only main functions
            do {
                try await transcriber.prewarm()
                XCTFail("\(section) \(function): an io block without one of the package's outputs was accepted")
            } catch let error as BundleError {
                guard case .ioMismatch(let component, let f, let detail) = error else { return XCTFail("\(error)") }
                XCTAssertEqual(component, section)
                XCTAssertEqual(f, function)
                XCTAssertTrue(detail.contains(section == "encoder" ? "output 'encoder_hidden_states' is not in the manifest"
                                                                    : "no output 'extra'"), detail)
            }
        }
    }

    func testCheckIORejectsAnExtraArrayWhenExact() {
        let want = ModelIO(inputs: ["a": .init(shape: [1], dtype: "int32")])
        let got = ModelIO(inputs: ["a": .init(shape: [1], dtype: "int32"), "b": .init(shape: [2], dtype: "float32")])
        XCTAssertNoThrow(try checkIO(got, expected: want, exact: false, component: "c", function: "f"))
        XCTAssertThrowsError(try checkIO(got, expected: want, exact: true, component: "c", function: "f")) {
            XCTAssertTrue("\($0)".contains("input 'b' is not in the manifest"))
        }
    }
}
