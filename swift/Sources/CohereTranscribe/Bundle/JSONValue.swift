import Foundation

/// A JSON document read as Python's `json.loads` reads it, so the manifest checks (`ManifestCheck`) see
/// what the Python loader sees: object keys in file order (the first failing entry is the one named),
/// `NaN` / `Infinity` / `-Infinity` accepted as numbers (then refused by a range check), integers apart
/// from floats (`1.0` is not an integer, `true` is not a number), integers beyond 64 bits kept (as out
/// of range), strict strings (no raw control characters), nothing after the value.
public indirect enum JSONValue: Equatable, Sendable {
    case null
    case bool(Bool)
    case int(Int)
    /// An integer literal beyond Int64 (its digits).
    case bigInt(String)
    case double(Double)
    case string(String)
    case array([JSONValue])
    case object(JSONObject)

    /// Python's `==`: numbers compare by value (`True == 1 == 1.0`), NaN equals nothing.
    public static func == (a: JSONValue, b: JSONValue) -> Bool {
        switch (a, b) {
        case (.null, .null): return true
        case (.string(let x), .string(let y)): return x == y
        case (.array(let x), .array(let y)): return x == y
        case (.object(let x), .object(let y)): return x == y
        case (.bigInt(let x), .bigInt(let y)): return x == y
        default:
            guard let x = a.numericValue, let y = b.numericValue else { return false }
            switch (x, y) {
            case (.int(let i), .int(let j)): return i == j
            default: return x.asDouble == y.asDouble
            }
        }
    }

    private enum Numeric {
        case int(Int)
        case double(Double)
        var asDouble: Double { switch self { case .int(let i): return Double(i); case .double(let d): return d } }
    }

    private var numericValue: Numeric? {
        switch self {
        case .bool(let b): return .int(b ? 1 : 0)
        case .int(let i): return .int(i)
        case .double(let d): return .double(d)
        default: return nil
        }
    }

    public var object: JSONObject? { if case .object(let o) = self { return o } else { return nil } }

    /// Python's `json.dumps` of the value (for messages), cut to 60 characters as `bundle._show` does.
    public var shown: String {
        let text = jsonText(nonFinite: true)
        return text.count <= 60 ? text : String(text.prefix(57)) + "..."
    }

    /// The value as JSON text; `nonFinite`: NaN / Infinity as Python writes them, else as null (standard JSON).
    public func jsonText(nonFinite: Bool = false) -> String {
        switch self {
        case .null: return "null"
        case .bool(let b): return b ? "true" : "false"
        case .int(let i): return String(i)
        case .bigInt(let digits): return nonFinite ? digits : "null"
        case .double(let d):
            if d.isNaN { return nonFinite ? "NaN" : "null" }
            if d.isInfinite { return nonFinite ? (d > 0 ? "Infinity" : "-Infinity") : "null" }
            return "\(d)"
        case .string(let s): return JSONValue.quoted(s)
        case .array(let items): return "[" + items.map { $0.jsonText(nonFinite: nonFinite) }.joined(separator: ", ") + "]"
        case .object(let o):
            return "{" + o.keys.map { JSONValue.quoted($0) + ": " + o.values[$0]!.jsonText(nonFinite: nonFinite) }
                .joined(separator: ", ") + "}"
        }
    }

    /// A JSON string literal as Python's `json.dumps(..., ensure_ascii=False)` writes it: `"` `\\` and the
    /// control characters escaped (\n \r \t \b \f, the others as \u00xx), everything else as is.
    public static func quoted(_ s: String) -> String {
        var out = "\""
        for scalar in s.unicodeScalars {
            switch scalar {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\r": out += "\\r"
            case "\t": out += "\\t"
            case "\u{08}": out += "\\b"
            case "\u{0C}": out += "\\f"
            case _ where scalar.value < 0x20: out += String(format: "\\u%04x", scalar.value)
            default: out.unicodeScalars.append(scalar)
            }
        }
        return out + "\""
    }

    /// Parses UTF-8 JSON text; throws `JSONValue.SyntaxError` naming the offset.
    public static func parse(_ data: Data) throws -> JSONValue {
        var parser = Parser(bytes: [UInt8](data))
        parser.skipSpace()
        let value = try parser.value(depth: 0)
        parser.skipSpace()
        guard parser.at == parser.bytes.count else { throw SyntaxError(offset: parser.at, problem: "extra data") }
        return value
    }

    public struct SyntaxError: Error, CustomStringConvertible {
        public var offset: Int
        public var problem: String
        public var description: String { "\(problem) at byte \(offset)" }
    }

    private struct Parser {
        let bytes: [UInt8]
        var at = 0
        static let maxDepth = 512

        init(bytes: [UInt8]) { self.bytes = bytes }

        func fail(_ problem: String) -> SyntaxError { SyntaxError(offset: at, problem: problem) }

        mutating func skipSpace() {
            while at < bytes.count {
                switch bytes[at] {
                case 0x20, 0x09, 0x0a, 0x0d: at += 1
                default: return
                }
            }
        }

        mutating func literal(_ word: StaticString) -> Bool {
            let count = word.utf8CodeUnitCount
            guard at + count <= bytes.count else { return false }
            let w = word.utf8Start
            for i in 0..<count where bytes[at + i] != w[i] { return false }
            at += count
            return true
        }

        mutating func value(depth: Int) throws -> JSONValue {
            guard depth < Parser.maxDepth else { throw fail("nested too deep") }
            guard at < bytes.count else { throw fail("expecting a value") }
            switch bytes[at] {
            case UInt8(ascii: "{"):
                at += 1
                var object = JSONObject()
                skipSpace()
                if at < bytes.count, bytes[at] == UInt8(ascii: "}") { at += 1; return .object(object) }
                while true {
                    skipSpace()
                    guard at < bytes.count, bytes[at] == UInt8(ascii: "\"") else { throw fail("expecting a property name") }
                    let key = try string()
                    skipSpace()
                    guard at < bytes.count, bytes[at] == UInt8(ascii: ":") else { throw fail("expecting ':'") }
                    at += 1
                    skipSpace()
                    object[key] = try value(depth: depth + 1)
                    skipSpace()
                    guard at < bytes.count else { throw fail("unterminated object") }
                    if bytes[at] == UInt8(ascii: ",") { at += 1; continue }
                    if bytes[at] == UInt8(ascii: "}") { at += 1; return .object(object) }
                    throw fail("expecting ',' or '}'")
                }
            case UInt8(ascii: "["):
                at += 1
                var items: [JSONValue] = []
                skipSpace()
                if at < bytes.count, bytes[at] == UInt8(ascii: "]") { at += 1; return .array(items) }
                while true {
                    skipSpace()
                    items.append(try value(depth: depth + 1))
                    skipSpace()
                    guard at < bytes.count else { throw fail("unterminated array") }
                    if bytes[at] == UInt8(ascii: ",") { at += 1; continue }
                    if bytes[at] == UInt8(ascii: "]") { at += 1; return .array(items) }
                    throw fail("expecting ',' or ']'")
                }
            case UInt8(ascii: "\""):
                return .string(try string())
            default:
                if literal("null") { return .null }
                if literal("true") { return .bool(true) }
                if literal("false") { return .bool(false) }
                if literal("NaN") { return .double(.nan) }
                if literal("Infinity") { return .double(.infinity) }
                if literal("-Infinity") { return .double(-.infinity) }
                return try number()
            }
        }

        /// Python's number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?
        mutating func number() throws -> JSONValue {
            let start = at
            func digits() -> Int {
                let from = at
                while at < bytes.count, (0x30...0x39).contains(bytes[at]) { at += 1 }
                return at - from
            }
            if at < bytes.count, bytes[at] == UInt8(ascii: "-") { at += 1 }
            guard at < bytes.count, (0x30...0x39).contains(bytes[at]) else { at = start; throw fail("expecting a value") }
            if bytes[at] == UInt8(ascii: "0") { at += 1 } else { _ = digits() }
            var isInteger = true
            if at + 1 < bytes.count, bytes[at] == UInt8(ascii: "."), (0x30...0x39).contains(bytes[at + 1]) {
                at += 1
                _ = digits()
                isInteger = false
            }
            if at < bytes.count, bytes[at] == UInt8(ascii: "e") || bytes[at] == UInt8(ascii: "E") {
                let mark = at
                at += 1
                if at < bytes.count, bytes[at] == UInt8(ascii: "+") || bytes[at] == UInt8(ascii: "-") { at += 1 }
                if digits() == 0 { at = mark } else { isInteger = false }
            }
            let text = String(decoding: bytes[start..<at], as: UTF8.self)
            if isInteger { return Int(text).map { .int($0) } ?? .bigInt(text) }
            return .double(Double(text) ?? .nan)
        }

        mutating func hex4() throws -> UInt32 {
            guard at + 4 <= bytes.count, let v = UInt32(String(decoding: bytes[at..<at + 4], as: UTF8.self), radix: 16) else {
                throw fail("invalid \\uXXXX escape")
            }
            at += 4
            return v
        }

        mutating func string() throws -> String {
            at += 1  // the opening quote
            var scalars = String.UnicodeScalarView()
            var run = at  // start of the raw (unescaped) bytes not yet copied
            func flush(_ end: Int) throws {
                guard let s = String(bytes: bytes[run..<end], encoding: .utf8) else { throw fail("invalid UTF-8") }
                scalars.append(contentsOf: s.unicodeScalars)
            }
            while true {
                guard at < bytes.count else { throw fail("unterminated string") }
                let b = bytes[at]
                if b == UInt8(ascii: "\"") {
                    try flush(at)
                    at += 1
                    return String(scalars)
                }
                if b < 0x20 { throw fail("invalid control character") }
                if b != UInt8(ascii: "\\") { at += 1; continue }
                try flush(at)
                at += 1
                guard at < bytes.count else { throw fail("unterminated string") }
                let e = bytes[at]
                at += 1
                switch e {
                case UInt8(ascii: "\""): scalars.append("\"")
                case UInt8(ascii: "\\"): scalars.append("\\")
                case UInt8(ascii: "/"): scalars.append("/")
                case UInt8(ascii: "b"): scalars.append("\u{08}")
                case UInt8(ascii: "f"): scalars.append("\u{0c}")
                case UInt8(ascii: "n"): scalars.append("\n")
                case UInt8(ascii: "r"): scalars.append("\r")
                case UInt8(ascii: "t"): scalars.append("\t")
                case UInt8(ascii: "u"):
                    var v = try hex4()
                    if (0xD800..<0xDC00).contains(v), at + 6 <= bytes.count, bytes[at] == UInt8(ascii: "\\"),
                       bytes[at + 1] == UInt8(ascii: "u") {
                        let mark = at
                        at += 2
                        let low = try hex4()
                        if (0xDC00..<0xE000).contains(low) {
                            v = 0x10000 + ((v - 0xD800) << 10) + (low - 0xDC00)
                        } else {
                            at = mark
                        }
                    }
                    // a lone surrogate (Python keeps it; a Swift string cannot): U+FFFD
                    scalars.append(Unicode.Scalar(v) ?? "\u{FFFD}")
                default: throw fail("invalid escape")
                }
                run = at
            }
        }
    }
}

/// A JSON object: values by key, and the keys in file order (a repeated key keeps its first place and
/// its last value, as a Python dict does).
public struct JSONObject: Equatable, Sendable {
    public private(set) var keys: [String] = []
    public private(set) var values: [String: JSONValue] = [:]

    public init() {}

    public subscript(key: String) -> JSONValue? {
        get { values[key] }
        set {
            if let value = newValue {
                if values.updateValue(value, forKey: key) == nil { keys.append(key) }
            } else if values.removeValue(forKey: key) != nil {
                keys.removeAll { $0 == key }
            }
        }
    }

    public var count: Int { keys.count }

    /// (key, value) in file order.
    public var entries: [(key: String, value: JSONValue)] { keys.map { ($0, values[$0]!) } }

    /// Python dict equality: the same keys with equal values, whatever the order.
    public static func == (a: JSONObject, b: JSONObject) -> Bool { a.values == b.values }
}
