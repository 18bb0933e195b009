import Foundation

/// Token ids -> text with the bundle's `vocab.json` (id -> SentencePiece piece), as the Python side's
/// `decode_ids` (Hugging Face `tokenizer.decode(ids, skip_special_tokens=True).strip()`):
/// special pieces (`<|...|>`, `<unk>`, `<pad>`) dropped, runs of byte pieces `<0xNN>` joined and decoded
/// as UTF-8 (a run that is not valid UTF-8 gives one U+FFFD per byte, as `tokenizers`' ByteFallback),
/// `▁` turned into a space, surrounding whitespace trimmed.
public struct Detokenizer: Sendable {
    public let pieces: [String]

    public init(pieces: [String]) {
        self.pieces = pieces
    }

    /// Reads `vocab.json` (`{"0": "<unk>", "1": ..., ...}`, every id from 0 up).
    public init(vocabURL: URL) throws {
        guard FileManager.default.fileExists(atPath: vocabURL.path) else {
            throw BundleError.missingFile("vocabulary not found: \(vocabURL.path)")
        }
        let table: [String: String]
        do {
            table = try JSONDecoder().decode([String: String].self, from: Data(contentsOf: vocabURL))
        } catch {
            throw BundleError.unreadableManifest("\(vocabURL.lastPathComponent) is not an id -> piece JSON object: \(error)")
        }
        var pieces = [String](repeating: "", count: table.count)
        for (key, piece) in table {
            guard let id = Int(key), id >= 0, id < table.count else {
                throw BundleError.unreadableManifest("\(vocabURL.lastPathComponent): id '\(key)' is not in 0..<\(table.count)")
            }
            pieces[id] = piece
        }
        self.init(pieces: pieces)
    }

    /// What Python's `str.strip()` strips (`str.isspace`): ASCII whitespace, the separators \u{1C}-\u{1F},
    /// \u{85} and the Unicode space separators. Foundation's `.whitespacesAndNewlines` lacks \u{1C}-\u{1F}.
    public static let pythonWhitespace: CharacterSet = {
        var set = CharacterSet(charactersIn: "\t\n\u{0B}\u{0C}\r\u{1C}\u{1D}\u{1E}\u{1F} \u{85}\u{A0}\u{1680}\u{2028}\u{2029}\u{202F}\u{205F}\u{3000}")
        set.insert(charactersIn: "\u{2000}"..."\u{200A}")
        return set
    }()

    public static func isSpecial(_ piece: String) -> Bool {
        piece == "<unk>" || piece == "<pad>" || (piece.hasPrefix("<|") && piece.hasSuffix("|>"))
    }

    /// The byte of a `<0xNN>` piece.
    static func byteValue(_ piece: String) -> UInt8? {
        let u = Array(piece.utf8)
        guard u.count == 6, u[0] == 0x3C, u[1] == 0x30, u[2] == 0x78, u[5] == 0x3E else { return nil }
        return UInt8(String(decoding: u[3...4], as: UTF8.self), radix: 16)
    }

    /// Text of `ids` (unknown ids are an error, never silently dropped).
    public func decode(_ ids: [Int]) throws -> String {
        var text = ""
        var bytes: [UInt8] = []
        func flush() {
            guard !bytes.isEmpty else { return }
            if let s = String(validatingUTF8Bytes: bytes) {
                text += s
            } else {
                text += String(repeating: "\u{FFFD}", count: bytes.count)
            }
            bytes.removeAll()
        }
        for id in ids {
            guard id >= 0, id < pieces.count else {
                throw TranscriptionError.badOutput("token id \(id) is outside the vocabulary (\(pieces.count) pieces)")
            }
            let piece = pieces[id]
            if Detokenizer.isSpecial(piece) { continue }
            if let b = Detokenizer.byteValue(piece) {
                bytes.append(b)
                continue
            }
            flush()
            text += piece.replacingOccurrences(of: "\u{2581}", with: " ")
        }
        flush()
        return text.trimmingCharacters(in: Detokenizer.pythonWhitespace)
    }

    /// Joins window texts as `CohereAsrProcessor.decode` (and Python's `join_windows`) does: empty parts
    /// dropped, the first right-stripped, the others stripped, joined with one space, or with nothing for
    /// the manifest's `no_space_languages` (ja, zh).
    public static func joinWindows(_ texts: [String], language: String, noSpaceLanguages: [String] = ["ja", "zh"]) -> String {
        let parts = texts.filter { !$0.trimmingCharacters(in: pythonWhitespace).isEmpty }
        guard let first = parts.first else { return "" }
        let separator = noSpaceLanguages.contains(language) ? "" : " "
        var head = first
        while let last = head.unicodeScalars.last, pythonWhitespace.contains(last) {
            head.unicodeScalars.removeLast()
        }
        return ([head] + parts.dropFirst().map { $0.trimmingCharacters(in: pythonWhitespace) })
            .joined(separator: separator)
    }
}

extension String {
    /// Strict UTF-8 decoding (nil for invalid bytes, unlike `String(decoding:as:)` which repairs them).
    init?(validatingUTF8Bytes bytes: [UInt8]) {
        var iterator = bytes.makeIterator()
        var decoder = UTF8()
        var scalars = String.UnicodeScalarView()
        loop: while true {
            switch decoder.decode(&iterator) {
            case .scalarValue(let s): scalars.append(s)
            case .emptyInput: break loop
            case .error: return nil
            }
        }
        self = String(scalars)
    }
}
