@testable import CohereTranscribe
import Foundation
import XCTest

/// FIPS 180-4 / NIST CAVP example vectors, streaming against one-shot, and file digests against
/// coreutils' `sha256sum`.
final class SHA256Tests: XCTestCase {
    func testEmpty() {
        XCTAssertEqual(SHA256.hexDigest(Data()),
                       "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
        XCTAssertEqual(SHA256().finalize().count, 32)
    }

    func testABC() {
        XCTAssertEqual(SHA256.hexDigest(Data("abc".utf8)),
                       "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    }

    func testNIST448BitMessage() {
        // 56 bytes: the padding does not fit into the message's block (two final blocks).
        XCTAssertEqual(SHA256.hexDigest(Data("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq".utf8)),
                       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1")
    }

    func testOneMillionA() {
        XCTAssertEqual(SHA256.hexDigest(Data(repeating: UInt8(ascii: "a"), count: 1_000_000)),
                       "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0")
    }

    func testStreamingEqualsOneShot() {
        var generator = SplitMix64(seed: 7)
        let data = Data((0..<200_003).map { _ in UInt8(truncatingIfNeeded: generator.next()) })
        let oneShot = SHA256.hash(data)
        // Chunk sizes that cross block boundaries in every way (1, 63, 64, 65, ...), both update APIs.
        var s = SHA256()
        var offset = 0, i = 0
        let sizes = [1, 63, 64, 65, 0, 7, 128, 4096, 1000, 3]
        while offset < data.count {
            let n = min(sizes[i % sizes.count], data.count - offset)
            let chunk = data.subdata(in: offset..<(offset + n))
            if i % 2 == 0 { s.update(chunk) } else { chunk.withUnsafeBytes { s.update(bytes: $0) } }
            offset += n
            i += 1
        }
        XCTAssertEqual(s.finalize(), oneShot)
        XCTAssertEqual(s.finalize(), oneShot, "finalize must not change the state")
        // More input after finalize continues the same message.
        s.update(Data("x".utf8))
        XCTAssertEqual(s.finalize(), SHA256.hash(data + Data("x".utf8)))
        XCTAssertNotEqual(s.finalize(), oneShot)
    }

    func testFileDigestsEqualSha256sum() throws {
        #if os(macOS) || os(Linux)
        let dir = Fixtures.scratch.appendingPathComponent("sha256-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: dir) }
        var generator = SplitMix64(seed: 42)
        // Padding edge cases around 55/56/64 bytes, and a file of several 1 MiB read chunks.
        let lengths = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 128, 1000, (1 << 20) * 2 + 12345]
        var files: [URL] = []
        for n in lengths {
            let url = dir.appendingPathComponent("f\(n).bin")
            try Data((0..<n).map { _ in UInt8(truncatingIfNeeded: generator.next()) }).write(to: url)
            files.append(url)
        }
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["sha256sum"] + files.map(\.path)
        let pipe = Pipe()
        process.standardOutput = pipe
        try process.run()
        let output = String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        XCTAssertEqual(process.terminationStatus, 0)
        let expected = Dictionary(uniqueKeysWithValues: output.split(separator: "\n").map { line -> (String, String) in
            let parts = line.split(separator: " ", maxSplits: 1)
            return (String(parts[1].drop(while: { $0 == " " || $0 == "*" })), String(parts[0]))
        })
        XCTAssertEqual(expected.count, files.count)
        for url in files {
            let want = try XCTUnwrap(expected[url.path], url.path)
            XCTAssertEqual(try SHA256.hexDigest(ofFile: url), want, url.lastPathComponent)
            XCTAssertEqual(SHA256.hexDigest(try Data(contentsOf: url)), want, url.lastPathComponent)
        }
        #else
        throw XCTSkip("sha256sum \(Fixtures.noChildProcesses)")
        #endif
    }

    func testHexString() {
        XCTAssertEqual([0x00, 0x0f, 0xa5, 0xff].hexString, "000fa5ff")
        XCTAssertEqual([UInt8]().hexString, "")
    }
}
