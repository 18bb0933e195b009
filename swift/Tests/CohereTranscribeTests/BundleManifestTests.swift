@testable import CohereTranscribe
import Foundation
import XCTest

final class BundleManifestTests: XCTestCase {
    func manifestJSON() throws -> [String: Any] {
        let data = try Data(contentsOf: try Fixtures.require().appendingPathComponent("bundle/manifest.json"))
        return try JSONSerialization.jsonObject(with: data) as! [String: Any]
    }

    /// A copy of the test bundle whose manifest is `edit`ed (packages linked, not copied).
    func editedBundle(_ edit: (inout [String: Any]) -> Void) throws -> URL {
        var json = try manifestJSON()
        edit(&json)
        let dir = FileManager.default.temporaryDirectory.appendingPathComponent("cohere-swift-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        for name in try FileManager.default.contentsOfDirectory(atPath: Fixtures.bundle.path) where name != "manifest.json" {
            try FileManager.default.createSymbolicLink(at: dir.appendingPathComponent(name),
                                                       withDestinationURL: Fixtures.bundle.appendingPathComponent(name))
        }
        try JSONSerialization.data(withJSONObject: json).write(to: dir.appendingPathComponent("manifest.json"))
        return dir
    }

    func testRealExportedManifestDecodes() throws {
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        let json = try manifestJSON()
        let decoder = json["decoder"] as! [String: Any]
        XCTAssertEqual(m.format_version, 1)
        XCTAssertEqual(m.decoder.capacity, decoder["capacity"] as? Int)
        XCTAssertEqual(m.decoder.cache_shape, decoder["cache_shape"] as? [Int])
        XCTAssertEqual(m.decoder.functions?.prefill, "prefill")
        XCTAssertEqual(m.decoder.prefill_length, 10)
        XCTAssertEqual(m.encoderBuckets.map(\.function), ["window_10s", "main"])
        XCTAssertEqual(m.encoderBuckets.map(\.frames), [1000, 3500])
        XCTAssertEqual(m.tokens.eos_token_ids, [3])
        let en = (json["languages"] as! [String: [String: [Int]]])["en"]!
        XCTAssertEqual(try m.prompt(language: "en"), en["punctuation"])
        XCTAssertEqual(try m.prompt(language: "en", punctuation: false), en["no_punctuation"])
        XCTAssertEqual(m.languages.count, 14)
    }

    func testNewerFormatVersionIsRefused() throws {
        let dir = try editedBundle { $0["format_version"] = 2 }
        XCTAssertThrowsError(try BundleManifest.load(bundle: dir)) { error in
            XCTAssertEqual(error as? BundleError, .newerFormatVersion(found: 2, supported: 1))
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

    /// A manifest whose shapes do not match the packages: the transcriber names the array and both shapes.
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
            guard case .ioMismatch(let component, _, let detail) = error else { return XCTFail("\(error)") }
            XCTAssertEqual(component, "decoder")
            XCTAssertTrue(detail.contains("cross_k") && detail.contains("the manifest says"), detail)
        }
        // a manifest io block that names an input the package lacks
        let dir2 = try editedBundle { json in
            var encoder = json["encoder"] as! [String: Any]
            encoder["io"] = ["inputs": ["input_features": ["shape": [1, 128, 3500], "dtype": "float32"],
                                        "feature_length": ["shape": [1], "dtype": "int32"],
                                        "speaker": ["shape": [1], "dtype": "int32"]]]
            json["encoder"] = encoder
        }
        do {
            _ = try await CohereTranscriber(bundle: dir2, runtime: runtime)
            XCTFail("a manifest io block naming a missing input was accepted")
        } catch let error as BundleError {
            XCTAssertTrue("\(error)".contains("no input 'speaker'"), "\(error)")
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
