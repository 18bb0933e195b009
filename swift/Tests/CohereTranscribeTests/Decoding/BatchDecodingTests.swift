@testable import CohereTranscribe
import Foundation
import XCTest

/// Several windows decoded at once (`decoder.batch`, the decoder's `step_batch`; docs/bundle.md, "Decoding several
/// windows at once"): the manifest block and its refusals, the loop of the written rule replayed on a scripted
/// decoder against the shared vectors (tests/data/batch_decoding_vectors.json, the file the Python test replays), and
/// the transcriber's batched clips against one window at a time on the test bundle.
final class BatchDecodingTests: XCTestCase {
    // MARK: - the manifest block

    func manifestObject(_ bundle: URL = Fixtures.bundle) throws -> [String: Any] {
        _ = try Fixtures.require()
        return try JSONSerialization.jsonObject(with: Data(contentsOf: bundle.appendingPathComponent("manifest.json")))
            as! [String: Any]
    }

    /// `edit` applied to the decoder section of `manifest`, then decoded: the field the refusal names (nil: accepted).
    func refusal(_ manifest: [String: Any], _ edit: (inout [String: Any]) -> Void) throws -> String? {
        var m = manifest
        var decoder = m["decoder"] as! [String: Any]
        edit(&decoder)
        m["decoder"] = decoder
        do {
            _ = try BundleManifest.decode(try JSONSerialization.data(withJSONObject: m))
            return nil
        } catch let error as BundleError {
            XCTAssertFalse(error.description.contains("\n"), "one line: \(error)")
            if let field = error.field { XCTAssertTrue(error.description.contains(field), "\(error)") }
            return error.field
        }
    }

    static func set(_ value: Any, at path: [String], in object: inout [String: Any]) {
        guard let key = path.first else { return }
        if path.count == 1 {
            object[key] = value
        } else {
            var inner = object[key] as! [String: Any]
            set(value, at: Array(path.dropFirst()), in: &inner)
            object[key] = inner
        }
    }

    func testTheBatchBlockIsReadAndABrokenOneIsRefusedNamingTheField() throws {
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        let batch = try XCTUnwrap(m.decoder.batch, "the test bundle's decoder has its batched step (the default export)")
        XCTAssertGreaterThan(batch.size, 1)
        XCTAssertEqual(m.decoder.functions?.stepBatch, "step_batch")
        let listed = try XCTUnwrap(m.listedIO(component: "decoder", function: "step_batch"))
        XCTAssertEqual(listed, m.expectedBatchDecoderIO())  // what the transcriber checks the loaded function against
        XCTAssertEqual(listed.states["cross_k"]?.shape[1], batch.size * m.decoder.cacheShape[1])
        XCTAssertEqual(listed.states["cross_mask"]?.shape[0], batch.size)

        let json = try manifestObject()
        let b = batch.size, kv = m.decoder.cacheShape[1]
        XCTAssertNil(try refusal(json) { _ in })
        let cases: [(String, (inout [String: Any]) -> Void)] = [
            ("decoder.batch.size", { Self.set(b + 1, at: ["batch", "size"], in: &$0) }),
            ("decoder.batch.size", { Self.set(1, at: ["batch", "size"], in: &$0) }),
            ("decoder.batch.size", { Self.set("4", at: ["batch", "size"], in: &$0) }),
            ("decoder.batch", { $0["batch"] = nil }),  // step_batch named, no block
            ("decoder.batch", { Self.set(NSNull(), at: ["functions", "step_batch"], in: &$0) }),  // a block, no function
            ("decoder.batch", { $0["batch"] = [1, 2] }),
            ("decoder.functions.step_batch", { Self.set(5, at: ["functions", "step_batch"], in: &$0) }),
            ("decoder.batch.io", { Self.set(NSNull(), at: ["batch", "io"], in: &$0) }),
            ("decoder.batch.io.inputs", { Self.set(["shape": [b], "dtype": "int32"], at: ["batch", "io", "inputs", "encoder_length"], in: &$0) }),
            ("decoder.batch.io.inputs.position.shape", { Self.set([1], at: ["batch", "io", "inputs", "position", "shape"], in: &$0) }),
            ("decoder.batch.io.states.cross_mask.shape",  // a row's mask, not B rows
             { Self.set([1, 1, 1, m.encoder.memoryLength], at: ["batch", "io", "states", "cross_mask", "shape"], in: &$0) }),
            ("decoder.batch.io.outputs.new_k.shape",  // Hkv heads, not B * Hkv
             { Self.set([m.decoder.cacheShape[0], kv, 1, m.decoder.cacheShape[3]], at: ["batch", "io", "outputs", "new_k", "shape"], in: &$0) }),
            ("decoder.batch.io.states.self_v.dtype", { Self.set("float32", at: ["batch", "io", "states", "self_v", "dtype"], in: &$0) }),
        ]
        for (field, edit) in cases {
            XCTAssertEqual(try refusal(json, edit), field)
        }
        // the graph-state decoder has no batched step: a block there is refused; without one it reads as batch 1
        let graph = try manifestObject(Fixtures.graphBundle)
        XCTAssertNil(try BundleManifest.load(bundle: Fixtures.graphBundle).decoder.batch)
        XCTAssertEqual(try refusal(graph) {
            $0["batch"] = (json["decoder"] as! [String: Any])["batch"]
            Self.set("step_batch", at: ["functions", "step_batch"], in: &$0)
        }, "decoder.batch")
    }
}
