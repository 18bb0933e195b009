@testable import CohereTranscribe
import Foundation
import XCTest

final class DetokenizerTests: XCTestCase {
    /// Every case of tokens_<name>.json: Swift's text equals Python's decode_ids.
    func check(_ name: String) throws -> (cases: Int, bytes: Int) {
        let fixture = try Fixtures.json("tokens_\(name).json") as! [String: Any]
        let detok = try Detokenizer(vocabURL: URL(fileURLWithPath: fixture["vocab"] as! String))
        var byteCases = 0
        let cases = fixture["cases"] as! [[String: Any]]
        for c in cases {
            let ids = c["ids"] as! [Int]
            XCTAssertEqual(try detok.decode(ids), c["text"] as! String, "ids \(ids)")
            if ids.contains(where: { Detokenizer.byteValue(detok.pieces[$0]) != nil }) { byteCases += 1 }
        }
        return (cases.count, byteCases)
    }

    func testBundleVocabularyMatchesPython() throws {
        let (n, bytes) = try check("bundle")
        XCTAssertGreaterThan(n, 300)
        XCTAssertGreaterThan(bytes, 20)  // CJK / Korean / emoji byte-fallback runs are really exercised
    }

    func testTinyTestCheckpointVocabularyMatchesPython() throws {
        let (n, bytes) = try check("tiny")
        XCTAssertGreaterThan(n, 300)
        XCTAssertGreaterThan(bytes, 20)
    }

    /// A detokenizer that decodes byte pieces one by one (no run joining) gets CJK wrong: the fixture
    /// depends on what is compared.
    func testBrokenByteHandlingWouldBeCaught() throws {
        let fixture = try Fixtures.json("tokens_bundle.json") as! [String: Any]
        let detok = try Detokenizer(vocabURL: URL(fileURLWithPath: fixture["vocab"] as! String))
        let cjk = (fixture["cases"] as! [[String: Any]]).first { ($0["text"] as! String) == "日本語のテキストです" }!
        let ids = cjk["ids"] as! [Int]
        let perByte = ids.map { id -> String in
            let piece = detok.pieces[id]
            if let b = Detokenizer.byteValue(piece) { return String(decoding: [b], as: UTF8.self) }
            return piece.replacingOccurrences(of: "\u{2581}", with: " ")
        }.joined().trimmingCharacters(in: .whitespaces)
        XCTAssertNotEqual(perByte, "日本語のテキストです")
        XCTAssertEqual(try detok.decode(ids), "日本語のテキストです")
    }

    func testUnknownIdIsAnError() throws {
        let detok = Detokenizer(pieces: ["<unk>", "\u{2581}a"])
        XCTAssertEqual(try detok.decode([0, 1]), "a")
        XCTAssertThrowsError(try detok.decode([2])) { XCTAssertTrue("\($0)".contains("outside the vocabulary")) }
    }

    func testJoinWindowsMatchesPython() throws {
        for c in try Fixtures.json("joins.json") as! [[String: Any]] {
            XCTAssertEqual(Detokenizer.joinWindows(c["texts"] as! [String], language: c["language"] as! String),
                           c["text"] as! String, "\(c)")
        }
    }
}
