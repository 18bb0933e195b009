@testable import CohereTranscribe
import Foundation
import XCTest

/// The word-timing rule (WordAlignment.swift) against the shared test vectors of the Python reference
/// (tests/data/alignment_vectors.json, written by tests/inference/test_alignment.py), read from the repository
/// as the other shared test data is.
final class WordAlignmentTests: XCTestCase {
    static let vectors = Fixtures.repoRoot.appendingPathComponent("tests/data/alignment_vectors.json")
    /// The times are sums and products of a few float64 values (offset + (frame + 0.5) x frame_seconds), the
    /// probabilities means of a few; only the order of float64 additions may differ from numpy's.
    static let tolerance = 1e-9

    func cases() throws -> [[String: Any]] {
        let doc = try JSONSerialization.jsonObject(with: Data(contentsOf: Self.vectors)) as! [String: Any]
        return doc["cases"] as! [[String: Any]]
    }

    static func run(_ c: [String: Any]) throws -> [(word: WordTiming, tokens: [Int])] {
        let attention = (c["attention"] as! [[[NSNumber]]]).map { $0.map { $0.map(\.doubleValue) } }
        return try WordAlignment.aligned(
            attention: attention, pieces: c["pieces"] as! [String],
            probabilities: (c["probabilities"] as! [NSNumber]).map(\.doubleValue),
            frameSeconds: (c["frame_seconds"] as! NSNumber).doubleValue,
            offsetSeconds: (c["offset_seconds"] as! NSNumber).doubleValue,
            leadRows: c["lead_rows"] as! Int, language: c["language"] as? String,
            standardise: c["standardise"] as! Bool, medianWidth: c["median_width"] as! Int)
    }

    /// Every case: the same words, token groups, times and probabilities as the Python rule.
    func testEveryVectorCaseMatchesThePythonRule() throws {
        let all = try cases()
        XCTAssertGreaterThanOrEqual(all.count, 12)
        var words = 0
        for c in all {
            let name = c["name"] as! String
            let expected = c["words"] as! [[String: Any]]
            let got = try Self.run(c)
            XCTAssertEqual(got.map(\.word.text), expected.map { $0["word"] as! String }, name)
            XCTAssertEqual(got.map(\.tokens), expected.map { $0["tokens"] as! [Int] }, name)
            guard got.count == expected.count else { continue }
            for (g, e) in zip(got, expected) {
                XCTAssertEqual(g.word.start, (e["start"] as! NSNumber).doubleValue, accuracy: Self.tolerance, "\(name): \(g.word.text)")
                XCTAssertEqual(g.word.end, (e["end"] as! NSNumber).doubleValue, accuracy: Self.tolerance, "\(name): \(g.word.text)")
                XCTAssertEqual(g.word.probability, (e["probability"] as! NSNumber).doubleValue, accuracy: Self.tolerance,
                               "\(name): \(g.word.text)")
            }
            words += got.count
        }
        print("WordAlignmentTests: \(all.count) vector cases, \(words) words, identical to the Python rule")
    }

    /// The public entry point gives the same words as the one the vectors check.
    func testWordsIsAlignedWithoutTheTokens() throws {
        let c = try cases()[0]
        let attention = (c["attention"] as! [[[NSNumber]]]).map { $0.map { $0.map(\.doubleValue) } }
        let words = try WordAlignment.words(attention: attention, pieces: c["pieces"] as! [String],
                                            probabilities: (c["probabilities"] as! [NSNumber]).map(\.doubleValue),
                                            frameSeconds: 0.08)
        XCTAssertEqual(words, try Self.run(c).map(\.word))
        XCTAssertEqual(words.map(\.text), ["Wake", "me", "up", "at", "two", "thirty."])
    }

    /// The tie order is what the uniform-attention vector pins: with every move tied, frame-first ties
    /// (the lead row taking one frame, the eos row the rest) give other times.
    func testTheTieVectorsPinTheTieOrder() throws {
        let c = try cases().first { ($0["name"] as! String).hasPrefix("uniform attention") }!
        let cost = [[Double]](repeating: [Double](repeating: 1, count: 9), count: 7)
        let path = WordAlignment.dtwPath(cost)
        // diagonal first from the end: the two extra frames go to the first row
        XCTAssertEqual(path.map(\.row), [0, 0, 0, 1, 2, 3, 4, 5, 6])
        XCTAssertEqual(path.map(\.frame), Array(0..<9))
        // the weights of the case (one value everywhere): the lead row takes frames 0-2, "Wake" starts in frame 3
        let weights = (c["attention"] as! [[[NSNumber]]]).map { $0.map { $0.map(\.doubleValue) } }
        let words = try WordAlignment.words(attention: weights, pieces: c["pieces"] as! [String],
                                            probabilities: (c["probabilities"] as! [NSNumber]).map(\.doubleValue),
                                            frameSeconds: 0.08, pauseFactor: 0)
        XCTAssertEqual(words.first?.start ?? 0, 3.5 * 0.08, accuracy: Self.tolerance)
    }

    func testTheRowsOfAnAlignCallAreCutAsPythonCutsThem() throws {
        // (2 heads, 16 positions, 6 frames), each weight = its position; prompt 10, 4 tokens, 5 valid frames
        let (heads, positions, frames) = (2, 16, 6)
        var flat: [Float] = []
        for _ in 0..<heads { for p in 0..<positions { flat += [Float](repeating: Float(p), count: frames) } }
        let rows = try WordAlignment.rows(flat, heads: heads, positions: positions, totalFrames: frames, promptLength: 10,
                                          tokens: 4, leadRows: 1, frames: 5)
        XCTAssertEqual(rows.count, 2)
        XCTAssertEqual(rows[1].map { $0[0] }, [8, 9, 10, 11, 12, 13])  // position p predicts token p + 1
        XCTAssertEqual(rows[0][0].count, 5)
        let three = try WordAlignment.rows(flat, heads: heads, positions: positions, totalFrames: frames, promptLength: 10,
                                           tokens: 4, leadRows: 3, frames: 6)
        XCTAssertEqual(three[0].prefix(3).map { $0[0] }, [6, 7, 8])
        XCTAssertThrowsError(try WordAlignment.rows(flat, heads: heads, positions: positions, totalFrames: frames,
                                                    promptLength: 10, tokens: 7, frames: 6)) {
            XCTAssertTrue("\($0)".contains("positions"), "\($0)")
        }
    }

    func testBadInputIsAOneLineError() throws {
        let ones = { (h: Int, r: Int, f: Int) in [[[Double]]](repeating: [[Double]](repeating: [Double](repeating: 1, count: f), count: r), count: h) }
        let pieces = ["\u{2581}a", "b"]
        for (attention, probabilities, expected) in [
            (ones(0, 4, 5), [1.0, 1], "no heads"),
            (ones(2, 5, 5), [1, 1], "5 rows, expected 4"),
            (ones(1, 4, 0), [1, 1], "no encoder frame"),
            (ones(1, 4, 5), [1], "1 token probabilities for 2"),
            ([[[1, 1], [1, 1], [1, 1], [1]]], [1, 1], "(heads, rows, frames)"),
            ([[[1, 1], [1, 1], [1, .nan], [1, 1]]], [1, 1], "finite"),
        ] as [([[[Double]]], [Double], String)] {
            XCTAssertThrowsError(try WordAlignment.words(attention: attention, pieces: pieces, probabilities: probabilities,
                                                         frameSeconds: 0.08)) {
                XCTAssertTrue("\($0)".contains(expected), "\($0) lacks \(expected)")
                XCTAssertFalse("\($0)".contains("\n"))
            }
        }
        XCTAssertThrowsError(try WordAlignment.words(attention: ones(1, 4, 5), pieces: pieces, probabilities: [1, 1],
                                                     frameSeconds: 0))
        XCTAssertThrowsError(try WordAlignment.words(attention: ones(1, 4, 5), pieces: pieces, probabilities: [1, 1],
                                                     frameSeconds: 0.08, medianWidth: 2))
    }

    /// Python's str.strip and code points, not Swift's Characters: "▁" followed by a combining accent is one
    /// Character but still opens a word; an information separator (U+001F) is whitespace to Python.
    func testPiecesAreReadAsCodePoints() {
        XCTAssertEqual(WordAlignment.wordGroups(["\u{2581}a", "\u{2581}\u{301}b", "c"], language: "en"), [[0], [1, 2]])
        XCTAssertEqual(WordAlignment.strip("\u{1F}a b\u{3000}"), "a b")
        XCTAssertEqual(WordAlignment.pieceBytes("<0xE5>"), [0xE5])
        XCTAssertEqual(WordAlignment.pieceBytes("<0xZZ>"), Array("<0xZZ>".utf8))
        XCTAssertNil(WordAlignment.strictUTF8([0xE5, 0xA4]))
        XCTAssertEqual(WordAlignment.strictUTF8([0xE5, 0xA4, 0xA9]), "\u{5929}")
    }

    /// Encoded as Python's word dicts.
    func testWordTimingEncodesAsPythonsWordDicts() throws {
        let word = WordTiming(text: "hi", start: 1.25, end: 1.5, probability: 0.75)
        let json = try JSONSerialization.jsonObject(with: JSONEncoder().encode(word)) as! [String: Any]
        XCTAssertEqual(Set(json.keys), ["word", "start", "end", "probability"])
        XCTAssertEqual(try JSONDecoder().decode(WordTiming.self, from: JSONEncoder().encode(word)), word)
    }
}
