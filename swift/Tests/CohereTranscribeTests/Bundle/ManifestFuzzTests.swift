@testable import CohereTranscribe
import Foundation
import XCTest

/// Fuzzing of the Swift readers (docs/reliability.md): the seeded corpus of mutated manifests that
/// tools/data/make_fuzz_manifests.py writes (the Python fuzz test's generator, run by `make swift-fixtures`)
/// through `BundleManifest.decode`, each with the Python loader's verdict to match, and seeded random /
/// truncated / corrupted WAV bytes through `WAVReader.parse`. Property: a value, or the package's own
/// error type (`BundleError`, `AudioError`) with a message; never another error, never a crash (a trap
/// or an out-of-bounds read ends the run).
final class ManifestFuzzTests: XCTestCase {
    static let seed: UInt64 = 22
    /// WAV cases: COHERE_FUZZ=long runs many more (as the Python fuzz tests do).
    static var wavCases: Int { ProcessInfo.processInfo.environment["COHERE_FUZZ"] == "long" ? 20000 : 600 }

    /// The Python loader's verdict of one corpus file (index.json, written by tools/data/make_fuzz_manifests.py):
    /// accepted, or refused at `stage` "manifest" (before the packages are opened: what the Swift manifest
    /// loader checks) or "packages" (only the package io differs: Swift's `checkIO`, at package load),
    /// and the field its error names (nil: an unreadable text, a file on disk ...).
    struct Verdict: Decodable {
        var accepted: Bool
        var stage: String?
        var field: String?
        var error: String?
    }

    struct Index: Decodable {
        var source: String
        var seed: Int
        var files: [String]
        var verdicts: [String: Verdict]
    }

    /// The corpus folder and its index: $COHERE_FUZZ_MANIFESTS (set by `make swift-test`; missing files are
    /// then a failure) or out/fuzz-manifests; without either the test is skipped, naming the command.
    func corpus() throws -> (dir: URL, index: Index) {
        let env = ProcessInfo.processInfo.environment["COHERE_FUZZ_MANIFESTS"]
        let dir = env.map { URL(fileURLWithPath: $0) } ?? Fixtures.repoRoot.appendingPathComponent("out/fuzz-manifests")
        guard let data = try? Data(contentsOf: dir.appendingPathComponent("index.json")) else {
            let message = "no fuzz corpus in \(dir.path): run `make swift-fixtures` (or tools/data/make_fuzz_manifests.py)"
            if env != nil { XCTFail(message) }
            throw XCTSkip(message)
        }
        return (dir, try JSONDecoder().decode(Index.self, from: data))
    }

    /// Everything a loaded manifest offers callers, exercised: none of it may trap on a decoded manifest.
    func exercise(_ m: BundleManifest) throws {
        _ = m.encoderBuckets
        for language in m.languages.keys.sorted() {
            _ = try m.prompt(language: language)
            _ = try m.prompt(language: language, punctuation: false)
        }
        for b in m.encoderBuckets {
            _ = m.listedIO(component: "encoder", function: b.function)
            _ = m.expectedEncoderIO(frames: b.frames)
        }
        _ = m.listedIO(component: "decoder", function: m.decoder.functions?.step ?? "main")
        _ = m.expectedDecoderIO()
        _ = m.expectedDecoderIO(prefillLength: m.decoder.prefillLength)
        _ = m.frontEndFunction(samples: 16000, frames: 100)
        for (name, f) in m.vad?.functions ?? [:] {
            _ = m.listedIO(component: "vad", function: name)
            _ = m.expectedVADIO(chunks: f.chunks)
        }
        for (name, f) in m.frontend?.functions ?? [:] {
            _ = m.listedIO(component: "frontend", function: name)
            _ = m.expectedFrontEndIO(samples: f.samples, frames: f.frames)
        }
    }

    /// Every corpus manifest through `BundleManifest.decode` beside the files of the bundle it was mutated
    /// from (as `load(bundle:)` reads it): the Swift loader refuses what the Python loader refuses before
    /// opening the packages, naming the same field, and accepts the rest (those Python refuses only for
    /// the package io are accepted here, as Swift checks that when it loads a package); only
    /// `BundleError`s escape; everything an accepted manifest offers callers works.
    func testMutatedManifestsGetThePythonLoadersVerdict() throws {
        let (dir, index) = try corpus()
        let bundle = URL(fileURLWithPath: index.source).deletingLastPathComponent()
        XCTAssertTrue(FileManager.default.fileExists(atPath: bundle.appendingPathComponent("vocab.json").path),
                      "the corpus' source bundle \(bundle.path) is gone: run `make swift-fixtures`")
        XCTAssertEqual(index.verdicts.count, index.files.count)
        var accepted = 0, refused = 0, agree = 0, fieldsCompared = 0, packageStage = 0
        var mismatches: [String] = []
        let started = Date()
        for name in index.files {
            guard let verdict = index.verdicts[name] else { mismatches.append("\(name): no verdict in index.json"); continue }
            let data = try Data(contentsOf: dir.appendingPathComponent(name))
            let swiftAccepts = verdict.accepted || verdict.stage == "packages"
            if verdict.stage == "packages" { packageStage += 1 }
            do {
                let m = try BundleManifest.decode(data, bundle: bundle)
                accepted += 1
                try exercise(m)
                if swiftAccepts { agree += 1 } else {
                    mismatches.append("\(name): Swift accepts, Python refuses (\(verdict.field ?? "no field")): \(verdict.error ?? "")")
                }
            } catch let error as BundleError {
                refused += 1
                XCTAssertFalse(error.description.isEmpty, name)
                if swiftAccepts {
                    mismatches.append("\(name): Swift refuses (\(error)), Python accepts")
                } else if let field = verdict.field {
                    fieldsCompared += 1
                    if error.field == field { agree += 1 } else {
                        mismatches.append("\(name): Swift names \(error.field ?? "no field") (\(error)), Python '\(field)': \(verdict.error ?? "")")
                    }
                } else {
                    agree += 1
                }
            } catch {
                mismatches.append("\(name): \(type(of: error)) escaped BundleManifest.decode: \(error)")
            }
        }
        let pythonRefuses = index.verdicts.values.filter { !$0.accepted }.count
        print("ManifestFuzzTests: \(index.files.count) manifests (seed \(index.seed)): Python refuses \(pythonRefuses) "
              + "(\(packageStage) only for the package io), Swift refuses \(refused), accepts \(accepted); "
              + "verdicts agree \(agree) (\(fieldsCompared) refusals compared by the field named); "
              + String(format: "%.1f s", Date().timeIntervalSince(started)))
        XCTAssertEqual(mismatches.count, 0, "\(mismatches.count) verdicts differ, first: \n" + mismatches.prefix(15).joined(separator: "\n"))
        XCTAssertEqual(agree, index.files.count)
        XCTAssertGreaterThan(refused, index.files.count / 2, "most mutations break a field the loader checks")
        XCTAssertGreaterThan(accepted, 0, "the corpus holds manifests both loaders accept")
    }

    /// `JSONValue` reads what Python's `json.loads` reads, and refuses what it refuses.
    func testJSONValueReadsAsPythonDoes() throws {
        let v = try JSONValue.parse(Data(#"{"b": [NaN, Infinity, -Infinity, 1.0, 1, true, 100000000000000000000], "a": "\u00e9\ud83d\ude00", "b2": {}, "a": 2}"#.utf8))
        let o = try XCTUnwrap(v.object)
        XCTAssertEqual(o.keys, ["b", "a", "b2"])  // file order; a repeated key keeps its place, takes the last value
        XCTAssertEqual(o["a"], .int(2))
        guard case .array(let items)? = o["b"] else { return XCTFail("\(v)") }
        guard case .double(let nan) = items[0] else { return XCTFail("\(items[0])") }
        XCTAssertTrue(nan.isNaN)
        XCTAssertNotEqual(items[0], items[0])  // NaN equals nothing, as in Python
        XCTAssertEqual(items[1], .double(.infinity))
        XCTAssertEqual(items[2], .double(-.infinity))
        guard case .double = items[3] else { return XCTFail("1.0 is a float: \(items[3])") }
        XCTAssertEqual(items[3], items[4])  // but equal to 1, and to true (Python's ==)
        XCTAssertEqual(items[4], items[5])
        XCTAssertEqual(items[6], .bigInt("100000000000000000000"))
        XCTAssertEqual(try JSONValue.parse(Data(#""\u00e9\ud83d\ude00""#.utf8)), .string("\u{e9}\u{1F600}"))
        for bad in ["", "{", "{} x", "[1,]", "{\"a\" 1}", "\"a\u{01}b\"", "01", "-", "nan", "'a'", "[1] [2]", "\"\\x\""] {
            XCTAssertThrowsError(try JSONValue.parse(Data(bad.utf8)), bad)
        }
        // a refusal names the field of the first check that fails (in check_manifest's order, not the file's)
        var m = try XCTUnwrap(try JSONValue.parse(try Data(contentsOf: Fixtures.bundle.appendingPathComponent("manifest.json"))).object)
        var audio = try XCTUnwrap(m["audio"]?.object)
        audio["hop_length"] = .double(160.0)
        audio["preemphasis"] = .double(.nan)
        m["audio"] = .object(audio)
        XCTAssertThrowsError(try BundleManifest.decode(Data(JSONValue.object(m).jsonText(nonFinite: true).utf8))) {
            XCTAssertEqual(($0 as? BundleError)?.field, "audio.hop_length", "\($0)")
        }
    }

    // MARK: - WAVReader.parse

    /// A valid RIFF/WAVE header for `format` (1 PCM, 3 float), then `data`.
    static func wav(format: Int, channels: Int, rate: Int, bits: Int, data: [UInt8], extensible: Bool = false) -> [UInt8] {
        func le(_ v: Int, _ n: Int) -> [UInt8] { (0..<n).map { UInt8(truncatingIfNeeded: v >> (8 * $0)) } }
        let block = channels * bits / 8
        var fmt = le(extensible ? 0xFFFE : format, 2) + le(channels, 2) + le(rate, 4) + le(rate * block, 4) + le(block, 2) + le(bits, 2)
        if extensible { fmt += le(22, 2) + le(bits, 2) + le(0, 4) + le(format, 2) + [UInt8](repeating: 0, count: 14) }
        let body = Array("WAVE".utf8) + Array("fmt ".utf8) + le(fmt.count, 4) + fmt + Array("data".utf8) + le(data.count, 4) + data
        return Array("RIFF".utf8) + le(body.count, 4) + body
    }

    func testRandomAndCorruptedWAVBytesParseOrThrowAudioError() throws {
        var rng = SplitMix64(seed: Self.seed)  // the same cases on every run
        var real: [[UInt8]] = []
        for name in ["en_short.wav", "tiny_0.05s.wav", "silence_2s.wav"] {
            let url = Fixtures.repoRoot.appendingPathComponent("tests/data/audio/\(name)")
            real.append([UInt8](try Data(contentsOf: url)))
        }
        let encodings: [(Int, Int)] = [(1, 8), (1, 16), (1, 24), (1, 32), (3, 32), (3, 64), (1, 12), (3, 16), (2, 16), (1, 0)]
        var parsed = 0, refused = 0
        for i in 0..<Self.wavCases {
            var bytes: [UInt8]
            switch i % 6 {
            case 0:  // random bytes, half of them behind a RIFF/WAVE header
                bytes = (0..<Int.random(in: 0...512, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng) }
                if Bool.random(using: &rng) { bytes = Array("RIFF".utf8) + [0, 0, 0, 0] + Array("WAVE".utf8) + bytes }
            case 1:  // a real file cut short (every length of the header, then anywhere)
                let source = real[i % real.count]
                let cut = i < 600 ? min(i / 6, source.count) : Int.random(in: 0...source.count, using: &rng)
                bytes = Array(source.prefix(cut))
            case 2:  // bytes flipped anywhere in the first 64 (the header) or the rest
                bytes = real[i % real.count]
                for _ in 0..<Int.random(in: 1...6, using: &rng) {
                    let at = Bool.random(using: &rng) ? Int.random(in: 0..<64, using: &rng) : Int.random(in: 0..<bytes.count, using: &rng)
                    bytes[at] ^= UInt8.random(in: 1...255, using: &rng)
                }
            case 3:  // one header field overwritten: sizes, format, channels, rate, block align, bits
                bytes = real[i % real.count]
                let field = [(4, 4), (16, 4), (20, 2), (22, 2), (24, 4), (32, 2), (34, 2), (40, 4)].randomElement(using: &rng)!
                let value = [0, 1, 7, 255, 0xFFFF, 0xFFFF_FFFF, 0x7FFF_FFFF, 12345].randomElement(using: &rng)!
                for k in 0..<field.1 { bytes[field.0 + k] = UInt8(truncatingIfNeeded: value >> (8 * k)) }
            default:  // a synthesised header of any encoding, 0-8 channels, with a ragged data chunk
                let (format, bits) = encodings.randomElement(using: &rng)!
                let data = (0..<Int.random(in: 0...300, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng) }
                bytes = Self.wav(format: format, channels: Int.random(in: 0...8, using: &rng),
                                 rate: [0, 8000, 16000, 44100, 192000, 0x7FFF_FFFF].randomElement(using: &rng)!, bits: bits,
                                 data: data, extensible: i % 12 == 5)
                if Bool.random(using: &rng) { bytes = Array(bytes.prefix(Int.random(in: 0...bytes.count, using: &rng))) }
            }
            do {
                let wav = try WAVReader.parse(Data(bytes), name: "case-\(i).wav")
                XCTAssertGreaterThanOrEqual(wav.channels, 1)
                XCTAssertGreaterThan(wav.sampleRate, 0)
                XCTAssertLessThanOrEqual(wav.mono.count * wav.channels * wav.bitsPerSample / 8, bytes.count, "case \(i)")
                if !wav.isFloat {
                    XCTAssertTrue(wav.mono.allSatisfy { $0 >= -1 && $0 <= 1 }, "case \(i): PCM outside [-1, 1]")
                }
                parsed += 1
            } catch let error as AudioError {
                XCTAssertTrue(error.description.contains("case-\(i).wav"), "case \(i): \(error) names no file")
                refused += 1
            } catch {
                XCTFail("case \(i): \(type(of: error)) escaped WAVReader.parse: \(error)")
            }
        }
        print("ManifestFuzzTests: \(Self.wavCases) WAV cases (seed \(Self.seed)): parsed \(parsed), AudioError \(refused)")
        XCTAssertGreaterThan(refused, Self.wavCases / 4)
        XCTAssertGreaterThan(parsed, Self.wavCases / 10)
    }
}
