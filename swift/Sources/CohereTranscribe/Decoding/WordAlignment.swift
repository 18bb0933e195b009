import Foundation

/// One word of a transcript: its text, when it was spoken (seconds on the audio's timeline) and how sure the
/// model is of it (0...1, the mean of its tokens' probabilities). Encoded as Python's word dicts
/// (`"word"`, `"start"`, `"end"`, `"probability"`), so `--json` output reads the same from both.
public struct WordTiming: Sendable, Codable, Equatable {
    public var text: String
    public var start: Double
    public var end: Double
    public var probability: Double

    public init(text: String, start: Double, end: Double, probability: Double) {
        self.text = text
        self.start = start
        self.end = end
        self.probability = probability
    }

    enum CodingKeys: String, CodingKey {
        case text = "word"
        case start, end, probability
    }
}

/// Word timings from the decoder's cross-attention: the written rule of docs/word-timings.md, ported from its
/// Python reference (`cohere_coreml.inference.alignment.align_words`); the shared test vectors
/// (tests/data/alignment_vectors.json) pin both. As whisper-style aligners do (openai/whisper
/// `whisper/timing.py`), the attention of a few selected heads over one window's final tokens becomes a
/// monotonic token -> frame path by dynamic time warping, and tokens group into words.
///
/// Every step works on Unicode scalars (Python's code points), never on `Character`s, and in `Double`, so
/// the words and times are those of the Python rule.
public enum WordAlignment {
    /// Weights below this count as this before the log (a zero weight would give -infinity).
    public static let logFloor = 1e-10
    /// Step 9: a word longer than this many median word durations, at a pause, is clipped.
    public static let pauseFactor = 2.0
    /// Step 9: the median word duration counted at most this (seconds).
    public static let maxMedianWordSeconds = 0.7
    /// Rows before the text by default: the one predicting the prompt's last token.
    public static let defaultLeadRows = 1
    /// Languages written without spaces: a word per character.
    public static let noSpaceLanguages: Set<String> = ["ja", "zh"]
    /// . ! ? and the full-width 。！？ of ja/zh.
    static let sentenceEnds: Set<Unicode.Scalar> = [".", "!", "?", "\u{3002}", "\u{FF01}", "\u{FF1F}"]
    /// SentencePiece's word-start mark.
    static let wordBoundary: Unicode.Scalar = "\u{2581}"

    /// The words of one window (docs/word-timings.md, steps 1-10).
    /// - Parameters:
    ///   - attention: (heads, rows, frames) softmax weights of the selected heads over the window's valid encoder
    ///     frames; rows: `leadRows` rows before the text, one per piece (the row predicting it), one predicting eos.
    ///   - pieces: the text tokens' SentencePiece pieces (eos excluded).
    ///   - probabilities: each text token's probability.
    ///   - frameSeconds: one encoder frame in seconds (the manifest's `decoder.alignment.frame_seconds`).
    ///   - offsetSeconds: the window's start on the original audio's timeline.
    ///   - pauseFactor: 0 skips step 9.
    public static func words(attention: [[[Double]]], pieces: [String], probabilities: [Double], frameSeconds: Double,
                             offsetSeconds: Double = 0, leadRows: Int = defaultLeadRows, language: String? = nil,
                             standardise: Bool = false, medianWidth: Int = 1,
                             pauseFactor: Double = pauseFactor) throws -> [WordTiming] {
        try aligned(attention: attention, pieces: pieces, probabilities: probabilities, frameSeconds: frameSeconds,
                    offsetSeconds: offsetSeconds, leadRows: leadRows, language: language, standardise: standardise,
                    medianWidth: medianWidth, pauseFactor: pauseFactor).map(\.word)
    }

    /// `words(...)` with each word's token indices (into `pieces`).
    static func aligned(attention: [[[Double]]], pieces: [String], probabilities: [Double], frameSeconds: Double,
                        offsetSeconds: Double = 0, leadRows: Int = defaultLeadRows, language: String? = nil,
                        standardise: Bool = false, medianWidth: Int = 1,
                        pauseFactor: Double = pauseFactor) throws -> [(word: WordTiming, tokens: [Int])] {
        try check(attention, pieces: pieces, probabilities: probabilities, leadRows: leadRows)
        guard frameSeconds > 0 else { throw fail("frame_seconds must be > 0, got \(frameSeconds)") }
        if pieces.isEmpty { return [] }
        let matrix = try normalise(attention, standardise: standardise, medianWidth: medianWidth)
        let path = dtwPath(matrix.map { $0.map { -$0 } })
        let (starts, ends) = rowSpans(path, rows: matrix.count)
        let frames = Double(matrix[0].count)
        func time(_ boundary: Int) -> Double { offsetSeconds + min(Double(boundary) + 0.5, frames) * frameSeconds }

        let groups = wordGroups(pieces, language: language)
        let texts = groups.map { groupText(pieces, $0) }
        var spans = groups.map { (start: time(starts[leadRows + $0[0]]), end: time(ends[leadRows + $0[$0.count - 1]])) }
        if pauseFactor > 0 { spans = clipPauses(texts, spans, pauseFactor: pauseFactor) }
        return zip(groups, zip(texts, spans)).map { group, item in
            let probability = group.reduce(0.0) { $0 + probabilities[$1] } / Double(group.count)
            return (WordTiming(text: item.0, start: item.1.start, end: item.1.end, probability: probability), group)
        }
    }

    /// The rows the rule aligns, cut from the align function's output (heads, positions, frames) of one
    /// window: positions promptLength - 1 - leadRows ..< promptLength + tokens (the rows predicting the prompt's
    /// last `leadRows` tokens, each text token, and eos), frames `..< frames` (the window's valid encoder
    /// frames). Python's `alignment_rows`. `weights` is flat, row-major.
    public static func rows(_ weights: [Float], heads: Int, positions: Int, totalFrames: Int, promptLength: Int,
                            tokens: Int, leadRows: Int = defaultLeadRows, frames: Int) throws -> [[[Double]]] {
        let first = promptLength - 1 - leadRows
        let last = promptLength + tokens  // exclusive: the row predicting eos is promptLength + tokens - 1
        guard leadRows >= 0, first >= 0 else {
            throw fail("lead_rows must be 0...\(promptLength - 1) for a prompt of \(promptLength) tokens")
        }
        guard positions >= last else {
            throw fail("attention has \(positions) positions, fewer than the \(last) of a \(promptLength)-token prompt and "
                       + "\(tokens) text tokens")
        }
        guard weights.count == heads * positions * totalFrames, (1...max(totalFrames, 1)).contains(frames) else {
            throw fail("attention of \(weights.count) values is not (\(heads), \(positions), \(totalFrames)) with "
                       + "\(frames) valid frames")
        }
        return (0..<heads).map { h in
            (first..<last).map { p in
                let base = (h * positions + p) * totalFrames
                return weights[base..<base + frames].map(Double.init)
            }
        }
    }

    static func fail(_ message: String) -> TranscriptionError { .invalidArgument("word timings: \(message)") }

    // MARK: - steps

    /// Step 1: the shapes, or a one-line error naming what is wrong.
    static func check(_ attention: [[[Double]]], pieces: [String], probabilities: [Double], leadRows: Int) throws {
        guard !attention.isEmpty else { throw fail("attention has no heads: select at least one alignment head") }
        guard leadRows >= 0 else { throw fail("lead_rows must be >= 0, got \(leadRows)") }
        let rows = attention[0].count
        let frames = attention[0].first?.count ?? 0
        guard attention.allSatisfy({ $0.count == rows && $0.allSatisfy { $0.count == frames } }) else {
            throw fail("attention must be (heads, rows, frames): its heads or rows differ in size")
        }
        guard rows == leadRows + pieces.count + 1 else {
            throw fail("attention has \(rows) rows, expected \(leadRows + pieces.count + 1) "
                       + "(\(leadRows) before the text + \(pieces.count) tokens + 1 for eos)")
        }
        guard frames >= 1 else { throw fail("attention covers no encoder frame") }
        guard probabilities.count == pieces.count else {
            throw fail("\(probabilities.count) token probabilities for \(pieces.count) tokens")
        }
        guard attention.allSatisfy({ $0.allSatisfy { $0.allSatisfy { $0.isFinite && $0 >= 0 } } }) else {
            throw fail("attention weights must be finite and non-negative")
        }
    }

    /// Steps 2-4: (heads, rows, frames) weights -> (rows, frames) scores: the floored natural log, optionally
    /// standardised per frame over the rows (whisper's choice, off by default) and median-filtered along the
    /// frames, then the mean over heads. Sums run in index order, as numpy's reductions over these axes.
    static func normalise(_ attention: [[[Double]]], standardise: Bool, medianWidth: Int) throws -> [[Double]] {
        var scores = attention.map { $0.map { $0.map { Foundation.log(Swift.max($0, logFloor)) } } }
        let rows = scores[0].count, frames = scores[0][0].count
        if standardise {
            for h in scores.indices {
                for f in 0..<frames {
                    var sum = 0.0
                    for r in 0..<rows { sum += scores[h][r][f] }
                    let mean = sum / Double(rows)
                    var squares = 0.0
                    for r in 0..<rows { squares += (scores[h][r][f] - mean) * (scores[h][r][f] - mean) }
                    let std = (squares / Double(rows)).squareRoot()
                    for r in 0..<rows { scores[h][r][f] = (scores[h][r][f] - mean) / (std > 0 ? std : 1.0) }
                }
            }
        }
        if medianWidth > 1 {
            guard medianWidth % 2 == 1 else { throw fail("median_width must be odd, got \(medianWidth)") }
            scores = scores.map { $0.map { medianFilter($0, width: medianWidth) } }
        }
        return (0..<rows).map { r in
            (0..<frames).map { f in
                var sum = 0.0
                for h in scores.indices { sum += scores[h][r][f] }
                return sum / Double(scores.count)
            }
        }
    }

    /// Step 3: the median over a window of `width` (odd) frames, edges repeated.
    static func medianFilter(_ x: [Double], width: Int) -> [Double] {
        let half = width / 2
        let padded = [Double](repeating: x[0], count: half) + x + [Double](repeating: x[x.count - 1], count: half)
        return x.indices.map { padded[$0..<$0 + width].sorted()[half] }
    }

    /// Step 5: the minimum-cost monotonic path through `cost` (rows, frames) from (0, 0) to the last cell, as
    /// (row, frame) cells in order. D[i, j] = C[i, j] + min(D[i-1, j-1], D[i-1, j], D[i, j-1]); ties go to the
    /// diagonal, then the next row on the same frame, then the next frame on the same row. Python evaluates it
    /// by anti-diagonals; each cell's value depends only on its three predecessors, so this row-major order
    /// gives the same values and moves.
    static func dtwPath(_ cost: [[Double]]) -> [(row: Int, frame: Int)] {
        let n = cost.count, m = cost[0].count, width = m + 1
        var acc = [Double](repeating: .infinity, count: (n + 1) * width)
        var move = [UInt8](repeating: 0, count: (n + 1) * width)  // 0 diagonal, 1 next row, 2 next frame
        acc[0] = 0
        for i in 1...n {
            for j in 1...m {
                var best = acc[(i - 1) * width + j - 1], step: UInt8 = 0
                if acc[(i - 1) * width + j] < best { (best, step) = (acc[(i - 1) * width + j], 1) }
                if acc[i * width + j - 1] < best { (best, step) = (acc[i * width + j - 1], 2) }
                acc[i * width + j] = cost[i - 1][j - 1] + best
                move[i * width + j] = step
            }
        }
        var path: [(row: Int, frame: Int)] = []
        var (i, j) = (n, m)
        while i > 0 && j > 0 {
            path.append((i - 1, j - 1))
            switch move[i * width + j] {
            case 0: (i, j) = (i - 1, j - 1)
            case 1: i -= 1
            default: j -= 1
            }
        }
        return path.reversed()
    }

    /// Step 6: each row's first frame and last frame + 1 on the path.
    static func rowSpans(_ path: [(row: Int, frame: Int)], rows: Int) -> (starts: [Int], ends: [Int]) {
        var starts = [Int](repeating: -1, count: rows), ends = [Int](repeating: 0, count: rows)
        for (r, f) in path {
            if starts[r] < 0 { starts[r] = f }
            ends[r] = f + 1
        }
        return (starts, ends)
    }

    /// The UTF-8 bytes a piece stands for: `<0xNN>` one raw byte, "▁" a space.
    static func pieceBytes(_ piece: String) -> [UInt8] {
        let scalars = Array(piece.unicodeScalars)
        if scalars.count == 6, scalars[0..<3] == ["<", "0", "x"], scalars[5] == ">",
           let byte = UInt8(String(String.UnicodeScalarView(scalars[3..<5])), radix: 16) {
            return [byte]
        }
        var out = String.UnicodeScalarView()
        for s in scalars { out.append(s == wordBoundary ? " " : s) }
        return Array(String(out).utf8)
    }

    /// Python's `str.isspace` (the code points Python's `str.strip()` removes).
    static func isPythonSpace(_ s: Unicode.Scalar) -> Bool {
        switch s.value {
        case 0x09...0x0D, 0x1C...0x20, 0x85, 0xA0, 0x1680, 0x2000...0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000:
            return true
        default:
            return false
        }
    }

    /// `text` without leading and trailing whitespace (Python's `str.strip()`).
    static func strip(_ text: String) -> String {
        var scalars = Array(text.unicodeScalars)
        while let last = scalars.last, isPythonSpace(last) { scalars.removeLast() }
        let first = scalars.firstIndex { !isPythonSpace($0) } ?? scalars.count
        return String(String.UnicodeScalarView(scalars[first...]))
    }

    /// Strict UTF-8 decoding (nil for bytes that are not whole, valid UTF-8, as Python's `bytes.decode`).
    static func strictUTF8(_ bytes: [UInt8]) -> String? {
        var iterator = bytes.makeIterator()
        var decoder = UTF8()
        var scalars = String.UnicodeScalarView()
        while true {
            switch decoder.decode(&iterator) {
            case .scalarValue(let s): scalars.append(s)
            case .emptyInput: return String(scalars)
            case .error: return nil
            }
        }
    }

    /// A letter or a digit (Unicode general categories L* and N*).
    static func hasWordCharacter(_ text: String) -> Bool {
        text.unicodeScalars.contains {
            switch $0.properties.generalCategory {
            case .uppercaseLetter, .lowercaseLetter, .titlecaseLetter, .modifierLetter, .otherLetter,
                 .decimalNumber, .letterNumber, .otherNumber:
                return true
            default:
                return false
            }
        }
    }

    /// The text of a group of pieces (byte pieces decoded, invalid UTF-8 replaced, "▁" a space), stripped.
    static func groupText(_ pieces: [String], _ group: [Int]) -> String {
        strip(String(decoding: group.flatMap { pieceBytes(pieces[$0]) }, as: UTF8.self))
    }

    /// Step 7: the token indices of each word, in order (every index in exactly one word).
    static func wordGroups(_ pieces: [String], language: String?) -> [[Int]] {
        var groups: [[Int]] = []
        if let language, noSpaceLanguages.contains(language) {  // a word per character
            var pending: [Int] = [], buffer: [UInt8] = []
            for (k, piece) in pieces.enumerated() {
                pending.append(k)
                buffer += pieceBytes(piece)
                guard let text = strictUTF8(buffer) else { continue }  // a character's first bytes: wait
                if !strip(text).isEmpty {
                    groups.append(pending)
                } else if !groups.isEmpty {  // a bare space belongs to the character before it
                    groups[groups.count - 1] += pending
                } else {
                    groups.append(pending)
                }
                (pending, buffer) = ([], [])
            }
            if !pending.isEmpty { groups.append(pending) }
        } else {
            for (k, piece) in pieces.enumerated() {
                if piece.unicodeScalars.first == wordBoundary || groups.isEmpty {
                    groups.append([k])
                } else {
                    groups[groups.count - 1].append(k)
                }
            }
        }
        var merged: [[Int]] = []
        var carry: [Int] = []  // punctuation before the first word waits for it
        for group in groups {
            if !hasWordCharacter(groupText(pieces, group)) {
                if merged.isEmpty { carry += group } else { merged[merged.count - 1] += group }
                continue
            }
            merged.append(carry + group)
            carry = []
        }
        if !carry.isEmpty { merged.append(carry) }  // nothing but punctuation: one word
        return merged
    }

    /// Step 9: (start, end) of each word with the long words at pauses clipped (whisper's "truncate long words
    /// at sentence boundaries"): longer than `pauseFactor` x the median word duration (counted at most
    /// `maxMedianWordSeconds`), the first word or one after a sentence end starts that long before its end, a
    /// word ending a sentence ends that long after its start.
    static func clipPauses(_ texts: [String], _ spans: [(start: Double, end: Double)],
                           pauseFactor: Double = pauseFactor) -> [(start: Double, end: Double)] {
        guard !spans.isEmpty else { return [] }
        let durations = spans.map { $0.end - $0.start }.sorted()
        let middle = durations.count / 2
        let median = durations.count % 2 == 1 ? durations[middle] : (durations[middle - 1] + durations[middle]) / 2
        let longest = pauseFactor * min(maxMedianWordSeconds, median)
        return spans.enumerated().map { k, span in
            var (start, end) = span
            if end - start > longest {
                if k == 0 || texts[k - 1].unicodeScalars.last.map(sentenceEnds.contains) == true {
                    start = end - longest
                } else if texts[k].unicodeScalars.last.map(sentenceEnds.contains) == true {
                    end = start + longest
                }
            }
            return (start, end)
        }
    }
}
