@testable import CohereTranscribe
import Foundation
import XCTest

/// The manifest's optional `vad` entry (docs/vad.md): read, checked as Python's `_check_vad` checks it (the field
/// each broken entry names), optional per bundle, and the VAD mode's resolution against it.
final class VADManifestTests: XCTestCase {
    /// An io block of `chunks` rows as the export writes it.
    static func vadIO(_ chunks: Int) -> [String: Any] {
        func array(_ shape: [Int]) -> [String: Any] { ["shape": shape, "dtype": "float32"] }
        return ["inputs": ["frames": array([chunks, 576]), "h": array([1, 128]), "c": array([1, 128])],
                "outputs": ["probability": array([1, chunks]), "h_out": array([1, 128]), "c_out": array([1, 128])],
                "states": [String: Any]()]
    }

    /// The entry the export writes for a block of `chunks` rows.
    static func vadEntry(chunks: Int = 32) -> [String: Any] {
        ["model": "silero-vad",
         "source": ["package": "silero-vad", "version": "6.2.3", "file": "silero_vad_16k_op15.onnx",
                    "sha256": String(repeating: "0", count: 64)],
         "sample_rate": 16000, "chunk_samples": 512, "context_samples": 64, "hidden": 128, "precision": "fp16",
         "compute_units": "cpu_only",
         "functions": ["block": ["chunks": chunks, "io": vadIO(chunks)], "chunk": ["chunks": 1, "io": vadIO(1)]],
         "parity": NSNull()]
    }

    /// A bundle manifest without its VAD: no `vad`, no `files.vad`, no checksums of the VAD's files (the
    /// package and its parity record), `total_bytes` less their sizes. The test bundle is exported with a VAD
    /// (the export's default); the tests of a bundle without one, or with another entry, start from this.
    static func withoutVAD(_ manifest: [String: Any]) -> [String: Any] {
        var json = manifest
        json["vad"] = nil
        var files = json["files"] as! [String: Any]
        files["vad"] = nil
        json["files"] = files
        if var checksums = json["checksums"] as? [String: Any], var listed = checksums["files"] as? [String: Any] {
            for key in listed.keys where key.hasPrefix("vad.mlpackage/") || key == "vad.parity.json" {
                let size = (listed[key] as? [String: Any])?["size"] as? Int ?? 0
                listed[key] = nil
                checksums["total_bytes"] = (checksums["total_bytes"] as? Int ?? 0) - size
            }
            checksums["files"] = listed
            json["checksums"] = checksums
        }
        return json
    }

    /// The VAD's files in a bundle folder (not copied into a bundle without a VAD).
    static func isVADFile(_ name: String) -> Bool { name == "vad.mlpackage" || name == "vad.parity.json" }

    /// A copy of the test bundle without its VAD (`withoutVAD`; the other packages copied).
    static func bundleWithoutVAD() throws -> URL {
        _ = try Fixtures.require()
        let source = Fixtures.bundle
        let json = try JSONSerialization.jsonObject(with: Data(contentsOf: source.appendingPathComponent("manifest.json")))
            as! [String: Any]
        let dir = Fixtures.scratch.appendingPathComponent("cohere-swift-no-vad-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        for name in try FileManager.default.contentsOfDirectory(atPath: source.path) where name != "manifest.json" && !isVADFile(name) {
            try FileManager.default.copyItem(at: source.appendingPathComponent(name), to: dir.appendingPathComponent(name))
        }
        try JSONSerialization.data(withJSONObject: withoutVAD(json)).write(to: dir.appendingPathComponent("manifest.json"))
        return dir
    }

    /// The test bundle's manifest without its VAD (`withoutVAD`), with `vadEntry()` and `files.vad` added
    /// (`vad`), then `edit`ed.
    func manifest(vad: Bool = true, _ edit: (inout [String: Any]) -> Void = { _ in }) throws -> [String: Any] {
        let data = try Data(contentsOf: try Fixtures.require().appendingPathComponent("bundle/manifest.json"))
        var json = Self.withoutVAD(try JSONSerialization.jsonObject(with: data) as! [String: Any])
        if vad {
            json["vad"] = Self.vadEntry()
            var files = json["files"] as! [String: Any]
            files["vad"] = "vad.mlpackage"
            json["files"] = files
        }
        edit(&json)
        return json
    }

    func decode(_ json: [String: Any]) throws -> BundleManifest {
        try BundleManifest.decode(try JSONSerialization.data(withJSONObject: json))
    }

    /// Sets the value at a dotted path (nil: removes it).
    static func set(_ json: inout [String: Any], _ path: [String], _ value: Any?) {
        guard let key = path.first else { return }
        if path.count == 1 {
            json[key] = value
            return
        }
        var inner = json[key] as? [String: Any] ?? [:]
        set(&inner, Array(path.dropFirst()), value)
        json[key] = inner
    }

    func testAManifestWithVADIsReadWithItsFunctions() throws {
        let m = try decode(try manifest { Self.set(&$0, ["vad"], Self.vadEntry(chunks: 48)) })
        let vad = try XCTUnwrap(m.vad)
        XCTAssertEqual(m.files.vad, "vad.mlpackage")
        XCTAssertTrue(m.files.named.contains { $0 == ("vad", "vad.mlpackage") })
        XCTAssertEqual(m.files.file(forKey: "vad"), "vad.mlpackage")
        XCTAssertEqual(vad.functions["block"]?.chunks, 48)
        XCTAssertEqual(vad.functions["chunk"]?.chunks, 1)
        XCTAssertEqual(vad.computeUnits, "cpu_only")
        // the io the loader checks a loaded function against: the manifest's, and the one its numbers give
        XCTAssertEqual(m.listedIO(component: "vad", function: "block"), m.expectedVADIO(chunks: 48))
        XCTAssertEqual(m.listedIO(component: "vad", function: "chunk"), m.expectedVADIO(chunks: 1))
        XCTAssertNotEqual(m.expectedVADIO(chunks: 48), m.expectedVADIO(chunks: 32))
    }

    /// A bundle without a VAD (no `vad`, or null with no `files.vad`) is valid: auto is off, on names the fix.
    func testABundleWithoutVADIsValidAndOnNamesTheExport() throws {
        for json in [try manifest(vad: false), try manifest(vad: false) { $0["vad"] = NSNull() }] {
            let m = try decode(json)
            XCTAssertNil(m.vad)
            XCTAssertNil(m.files.vad)
            let bundle = URL(fileURLWithPath: "/tmp/some-bundle")
            XCTAssertFalse(try VADMode.auto.resolve(bundleHasVAD: m.vad != nil, bundle: bundle))
            XCTAssertFalse(try VADMode.off.resolve(bundleHasVAD: m.vad != nil, bundle: bundle))
            XCTAssertThrowsError(try VADMode.on.resolve(bundleHasVAD: m.vad != nil, bundle: bundle)) {
                XCTAssertEqual("\($0)", "bundle /tmp/some-bundle has no vad.mlpackage: re-export with "
                               + "`cohere-coreml export --vad` (the default)")
            }
        }
        XCTAssertTrue(try VADMode.auto.resolve(bundleHasVAD: true, bundle: URL(fileURLWithPath: "/b")))
        XCTAssertTrue(try VADMode.on.resolve(bundleHasVAD: true, bundle: URL(fileURLWithPath: "/b")))
        XCTAssertFalse(try VADMode.off.resolve(bundleHasVAD: true, bundle: URL(fileURLWithPath: "/b")))
    }

    /// Each broken entry is refused naming the field Python's check names.
    func testBrokenVADEntriesAreRefusedNamingTheField() throws {
        let cases: [(String, (inout [String: Any]) -> Void, String)] = [
            ("no files.vad", { Self.set(&$0, ["files", "vad"], nil) }, "vad"),
            ("no vad entry", { $0["vad"] = nil }, "vad"),
            ("vad not an object", { $0["vad"] = [1, 2] }, "vad"),
            ("8 kHz", { Self.set(&$0, ["vad", "sample_rate"], 8000) }, "vad.sample_rate"),
            ("sample rate missing", { Self.set(&$0, ["vad", "sample_rate"], nil) }, "vad.sample_rate"),
            ("256-sample chunks", { Self.set(&$0, ["vad", "chunk_samples"], 256) }, "vad.chunk_samples"),
            ("no context", { Self.set(&$0, ["vad", "context_samples"], 0) }, "vad.context_samples"),
            ("hidden 64", { Self.set(&$0, ["vad", "hidden"], 64) }, "vad.hidden"),
            ("hidden a string", { Self.set(&$0, ["vad", "hidden"], "128") }, "vad.hidden"),
            ("no functions", { Self.set(&$0, ["vad", "functions"], nil) }, "vad.functions"),
            ("no block function", { Self.set(&$0, ["vad", "functions", "block"], nil) }, "vad.functions.block"),
            ("no chunk function", { Self.set(&$0, ["vad", "functions", "chunk"], nil) }, "vad.functions.chunk"),
            ("block of 0 chunks", { Self.set(&$0, ["vad", "functions", "block", "chunks"], 0) }, "vad.functions.block.chunks"),
            ("block chunks not an integer", { Self.set(&$0, ["vad", "functions", "block", "chunks"], 32.5) }, "vad.functions.block.chunks"),
            ("chunk of 2", { Self.set(&$0, ["vad", "functions", "chunk", "chunks"], 2) }, "vad.functions.chunk.chunks"),
            ("block io of other chunks", { Self.set(&$0, ["vad", "functions", "block", "chunks"], 64) },
             "vad.functions.block.io.inputs.frames.shape"),
            ("frames of 512 samples", {
                Self.set(&$0, ["vad", "functions", "block", "io", "inputs", "frames", "shape"], [32, 512])
            }, "vad.functions.block.io.inputs.frames.shape"),
            ("h of 64", { Self.set(&$0, ["vad", "functions", "chunk", "io", "inputs", "h", "shape"], [1, 64]) },
             "vad.functions.chunk.io.inputs.h.shape"),
            ("no c input", { Self.set(&$0, ["vad", "functions", "block", "io", "inputs", "c"], nil) },
             "vad.functions.block.io.inputs"),
            ("probability of 2", {
                Self.set(&$0, ["vad", "functions", "chunk", "io", "outputs", "probability", "shape"], [1, 2])
            }, "vad.functions.chunk.io.outputs.probability.shape"),
            ("no c_out", { Self.set(&$0, ["vad", "functions", "block", "io", "outputs", "c_out"], nil) },
             "vad.functions.block.io.outputs"),
            ("no io", { Self.set(&$0, ["vad", "functions", "block", "io"], nil) }, "vad.functions.block.io"),
            ("a dtype outside the io dtypes", {
                Self.set(&$0, ["vad", "functions", "block", "io", "inputs", "h", "dtype"], "float64")
            }, "vad.functions.block.io.inputs.h.dtype"),
            ("an onnx file", { Self.set(&$0, ["files", "vad"], "vad.onnx") }, "files.vad"),
        ]
        for (name, edit, field) in cases {
            XCTAssertThrowsError(try decode(try manifest(edit)), name) { error in
                XCTAssertEqual((error as? BundleError)?.field, field, "\(name): \(error)")
            }
        }
    }

    /// A bundle that names vad.mlpackage without it, or whose checksums list a vad file of another size, is
    /// refused at load naming the file; the same bundle without the VAD entry loads (the package is optional).
    func testAMissingOrAlteredVADPackageIsNamedAtLoad() throws {
        let root = Fixtures.scratch.appendingPathComponent("vad-\(UUID().uuidString)")
        let source = Fixtures.bundle
        try FileManager.default.createDirectory(at: root, withIntermediateDirectories: true)
        for name in try FileManager.default.contentsOfDirectory(atPath: source.path) where name != "manifest.json" && !Self.isVADFile(name) {
            try FileManager.default.copyItem(at: source.appendingPathComponent(name), to: root.appendingPathComponent(name))
        }
        func write(_ json: [String: Any]) throws {
            try JSONSerialization.data(withJSONObject: json).write(to: root.appendingPathComponent("manifest.json"))
        }
        try write(try manifest())
        XCTAssertThrowsError(try BundleManifest.load(bundle: root)) { error in
            guard case BundleError.missingFile(let message) = error else { return XCTFail("\(error)") }
            XCTAssertTrue(message.contains("vad.mlpackage"), message)
        }
        // the package present but one of its files not the size the checksums list
        let weights = "vad.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        let url = root.appendingPathComponent(weights)
        try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
        try Data(repeating: 7, count: 100).write(to: url)
        try write(try manifest {
            var checksums = $0["checksums"] as! [String: Any]
            var files = checksums["files"] as! [String: Any]
            files[weights] = ["sha256": String(repeating: "a", count: 64), "size": 101]
            checksums["files"] = files
            checksums["total_bytes"] = (checksums["total_bytes"] as! Int) + 101
            $0["checksums"] = checksums
        })
        XCTAssertThrowsError(try BundleManifest.load(bundle: root)) { error in
            XCTAssertTrue("\(error)".contains("\(weights): size 100 != 101"), "\(error)")
        }
        try write(try manifest(vad: false))
        XCTAssertNil(try BundleManifest.load(bundle: root).vad)
    }
}
