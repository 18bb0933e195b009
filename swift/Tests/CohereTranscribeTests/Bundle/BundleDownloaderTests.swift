@testable import CohereTranscribe
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import XCTest

/// `BundleDownloader` against tools/testing/hub_test_server.py (Hub resolve layout on 127.0.0.1, Range
/// requests, fault injection, a request log).
final class BundleDownloaderTests: XCTestCase {
    static let repoId = "test-org/test-model"
    static let commit = "0123456789abcdef0123456789abcdef01234567"
    static let bigFile = "encoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin"

    var work: URL!
    var root: URL!          // what the server serves (`<root>/f16/...`)
    var destination: URL!   // `<work>/bundles/f16`
    var servers: [HubTestServer] = []

    override func setUpWithError() throws {
        work = Fixtures.scratch.appendingPathComponent("dl-\(UUID().uuidString)")
        root = work.appendingPathComponent("hub")
        destination = work.appendingPathComponent("bundles/f16")
        try FileManager.default.createDirectory(at: root, withIntermediateDirectories: true)
    }

    override func tearDownWithError() throws {
        servers.forEach { $0.stop() }
        servers = []
        try? FileManager.default.removeItem(at: work)
    }

    // MARK: - Cases

    func testHappyPathDownloadsEveryFileVerifiedAndManifestLast() async throws {
        let files = Self.bundleFiles(seed: 1)
        let manifest = try writeBundle(files)
        let server = try startServer()
        let staging = BundleDownloader.stagingFolder(for: destination)
        let destination = self.destination!
        let events = Box<[DownloadProgress]>([])
        let violations = Box<[String]>([])
        let result = try await downloader(server).download(folder: "f16", to: destination) { p in
            events.mutate { $0.append(p) }
            let fm = FileManager.default
            if p.currentFile != nil {
                // While files are fetched nothing is at the destination and no manifest is staged.
                if fm.fileExists(atPath: destination.path) { violations.mutate { $0.append("destination at \(p)") } }
                if fm.fileExists(atPath: staging.appendingPathComponent("manifest.json").path) {
                    violations.mutate { $0.append("staged manifest at \(p)") }
                }
            } else if !fm.fileExists(atPath: destination.appendingPathComponent("manifest.json").path) {
                violations.mutate { $0.append("done reported before the bundle was in place") }
            }
        }
        XCTAssertEqual(result.standardizedFileURL.path, destination.standardizedFileURL.path)
        XCTAssertEqual(violations.value, [])
        XCTAssertEqual(try tree(destination), files.merging(["manifest.json": manifest]) { a, _ in a })
        XCTAssertFalse(FileManager.default.fileExists(atPath: staging.path), "staging folder left behind")
        XCTAssertEqual(try leftovers(), [], "nothing but the bundle beside the destination")
        // manifest.json was written after every file.
        let manifestDate = try modificationDate(destination.appendingPathComponent("manifest.json"))
        for path in files.keys { XCTAssertLessThanOrEqual(try modificationDate(destination.appendingPathComponent(path)), manifestDate, path) }
        // Progress: non-decreasing, ends at checksums.total_bytes with no current file, each file announced.
        let total = Int64(files.values.reduce(0) { $0 + $1.count })
        let seen = events.value
        XCTAssertEqual(seen.last, DownloadProgress(bytesDone: total, totalBytes: total, currentFile: nil))
        XCTAssertTrue(zip(seen, seen.dropFirst()).allSatisfy { $0.bytesDone <= $1.bytesDone }, "\(seen)")
        XCTAssertTrue(seen.allSatisfy { $0.totalBytes == total })
        XCTAssertEqual(Set(seen.compactMap(\.currentFile)), Set(files.keys))
        // One request per file, at the commit the manifest response announced; the manifest first.
        let log = try server.requests()
        XCTAssertEqual(log.first?.path, "/\(Self.repoId)/resolve/main/f16/manifest.json")
        let filePaths = log.dropFirst().map(\.path)
        XCTAssertEqual(filePaths.sorted(), files.keys.filter { !(files[$0]!.isEmpty) }
            .map { "/\(Self.repoId)/resolve/\(Self.commit)/f16/\($0)" }.sorted())
        XCTAssertTrue(log.allSatisfy { $0.range == nil && !$0.auth })
        XCTAssertNoThrow(try BundleDownloader.verify(bundle: destination))
    }

    func testUpToDateDestinationIsKeptWithoutDownloading() async throws {
        let files = Self.bundleFiles(seed: 2)
        try writeBundle(files)
        let server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        let before = try server.requests().count
        try await downloader(server).download(folder: "f16", to: destination)
        let after = try server.requests().dropFirst(before)
        XCTAssertEqual(after.map(\.path), ["/\(Self.repoId)/resolve/main/f16/manifest.json"])
        // A file of the wrong size is not "up to date": everything is fetched again and replaced.
        try Data("short".utf8).write(to: destination.appendingPathComponent("vocab.json"))
        try await downloader(server).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination).filter { $0.key != "manifest.json" }, files)
    }

    func testVerifyNamesACorruptedFile() async throws {
        let files = Self.bundleFiles(seed: 3)
        try writeBundle(files)
        let server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        XCTAssertNoThrow(try BundleDownloader.verify(bundle: destination))
        let url = destination.appendingPathComponent(Self.bigFile)
        var data = try Data(contentsOf: url)
        data[100] ^= 1
        try data.write(to: url)
        XCTAssertThrowsError(try BundleDownloader.verify(bundle: destination)) { error in
            guard case .hashMismatch(let path, let got, let expected)? = error as? DownloadError else {
                return XCTFail("\(error)")
            }
            XCTAssertEqual(path, Self.bigFile)
            XCTAssertEqual(got, SHA256.hexDigest(data))
            XCTAssertEqual(expected, SHA256.hexDigest(files[Self.bigFile]!))
        }
    }

    /// vad.mlpackage (optional, docs/vad.md) is fetched and verified as every listed file is: an altered weight
    /// is named; the other tests' bundles have none and download as well.
    func testAVADPackageIsDownloadedAndAnAlteredOneNamed() async throws {
        var generator = SplitMix64(seed: 12)
        let weights = "vad.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        var files = Self.bundleFiles(seed: 12)
        files["vad.mlpackage/Manifest.json"] = Data("{\"fileFormatVersion\": \"1.0.0\"}".utf8)
        files["vad.mlpackage/Data/com.apple.CoreML/model.mlmodel"] = Data((0..<900).map { _ in UInt8(truncatingIfNeeded: generator.next()) })
        files[weights] = Data((0..<4000).map { _ in UInt8(truncatingIfNeeded: generator.next()) })
        let manifest = try writeBundle(files)
        let server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination), files.merging(["manifest.json": manifest]) { a, _ in a })
        XCTAssertNoThrow(try BundleDownloader.verify(bundle: destination))
        let url = destination.appendingPathComponent(weights)
        var data = try Data(contentsOf: url)
        data[17] ^= 0x40
        try data.write(to: url)
        XCTAssertThrowsError(try BundleDownloader.verify(bundle: destination)) { error in
            guard case .hashMismatch(let path, _, _)? = error as? DownloadError else { return XCTFail("\(error)") }
            XCTAssertEqual(path, weights)
        }
    }

    func testMissingFileIsAnHTTPErrorNamingIt() async throws {
        let files = Self.bundleFiles(seed: 4)
        try writeBundle(files)
        let missing = "decoder.mlpackage/Data/com.apple.CoreML/model.mlmodel"
        let server = try startServer(["--missing", "f16/" + missing])
        let error = await downloadError(server)
        guard case .httpStatus(let url, let status)? = error else { return XCTFail("\(String(describing: error))") }
        XCTAssertEqual(status, 404)
        XCTAssertTrue(url.hasSuffix("/f16/" + missing), url)
        XCTAssertTrue(error!.description.contains(missing))
        assertNothingLoadable()
    }

    func testManifest404() async throws {
        let server = try startServer()   // nothing served
        let error = await downloadError(server)
        guard case .httpStatus(let url, 404)? = error else { return XCTFail("\(String(describing: error))") }
        XCTAssertTrue(url.hasSuffix("/\(Self.repoId)/resolve/main/f16/manifest.json"), url)
        assertNothingLoadable()
    }

    func testTruncatedBodyIsReportedAndNothingLoadable() async throws {
        let files = Self.bundleFiles(seed: 5)
        try writeBundle(files)
        let server = try startServer(["--truncate", "f16/" + Self.bigFile])
        let error = await downloadError(server)
        let size = Int64(files[Self.bigFile]!.count)
        XCTAssertEqual(error, .truncated(path: Self.bigFile, received: size / 2, expected: size))
        assertNothingLoadable()
        // The received half is kept for a resume.
        let part = BundleDownloader.stagingFolder(for: destination).appendingPathComponent(Self.bigFile + ".part")
        XCTAssertEqual(try Data(contentsOf: part), files[Self.bigFile]!.prefix(Int(size / 2)))
    }

    func testFlippedByteIsAHashMismatch() async throws {
        let files = Self.bundleFiles(seed: 6)
        try writeBundle(files)
        let path = "encoder.mlpackage/Manifest.json"
        let server = try startServer(["--flip", "f16/" + path])
        let error = await downloadError(server)
        guard case .hashMismatch(let named, let got, let expected)? = error else {
            return XCTFail("\(String(describing: error))")
        }
        var flipped = files[path]!
        flipped[flipped.count / 2] ^= 0xff
        XCTAssertEqual(named, path)
        XCTAssertEqual(got, SHA256.hexDigest(flipped))
        XCTAssertEqual(expected, SHA256.hexDigest(files[path]!))
        assertNothingLoadable()
        // The bad bytes are not kept, neither as the file nor as a .part to resume from.
        let staging = BundleDownloader.stagingFolder(for: destination)
        XCTAssertFalse(FileManager.default.fileExists(atPath: staging.appendingPathComponent(path).path))
        XCTAssertFalse(FileManager.default.fileExists(atPath: staging.appendingPathComponent(path + ".part").path))
    }

    func testSizeOtherThanListedIsASizeMismatch() async throws {
        let files = Self.bundleFiles(seed: 18)
        try writeBundle(files)
        let server = try startServer()
        let path = "decoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        let real = Int64(files[path]!.count)
        for listed in [real + 10, real - 10] {
            var table = Self.checksums(files)
            var entries = table["files"] as! [String: Any]
            entries[path] = ["sha256": SHA256.hexDigest(files[path]!), "size": listed]
            table["files"] = entries
            table["total_bytes"] = (table["total_bytes"] as! Int) + Int(listed - real)
            try writeManifest(checksums: table)
            let error = await downloadError(server)
            guard case .sizeMismatch(let named, let size, let expected)? = error else {
                XCTFail("\(listed): \(String(describing: error))")
                continue
            }
            XCTAssertEqual(named, path)
            XCTAssertEqual(expected, listed)
            if listed > real { XCTAssertEqual(size, real) } else { XCTAssertGreaterThan(size, listed) }
            assertNothingLoadable()
            let part = BundleDownloader.stagingFolder(for: destination).appendingPathComponent(path + ".part")
            XCTAssertFalse(FileManager.default.fileExists(atPath: part.path), "a wrong-size .part is not kept")
        }
    }

    func testUnsafeManifestPathsAreRefusedBeforeAnyFileRequest() async throws {
        let files = Self.bundleFiles(seed: 7)
        try writeBundle(files)
        try Data("outside".utf8).write(to: root.appendingPathComponent("x"))
        let server = try startServer()
        for bad in ["../x", "/etc/passwd", "encoder.mlpackage/../../x", "./vocab.json", "a/./b", "a//b", "a\\b", "a/"] {
            let before = try server.requests().count
            var listed = files
            listed[bad] = Data("outside".utf8)
            try writeManifest(checksums: Self.checksums(listed))
            let error = await downloadError(server)
            guard case .unsafePath(let path, _)? = error else {
                XCTFail("\(bad): \(String(describing: error))")
                continue
            }
            XCTAssertEqual(path, bad)
            XCTAssertTrue(error!.description.contains(bad))
            XCTAssertEqual(try server.requests().dropFirst(before).map(\.path),
                           ["/\(Self.repoId)/resolve/main/f16/manifest.json"], bad)
            assertNothingLoadable()
        }
        XCTAssertFalse(FileManager.default.fileExists(atPath: work.appendingPathComponent("bundles/x").path))
    }

    func testManifestWithoutChecksumsIsRefused() async throws {
        let files = Self.bundleFiles(seed: 8)
        try writeBundle(files)
        try writeManifest(checksums: nil)
        let server = try startServer()
        let error = await downloadError(server)
        guard case .noChecksums(let url, _)? = error else { return XCTFail("\(String(describing: error))") }
        XCTAssertTrue(url.hasSuffix("/f16/manifest.json"), url)
        XCTAssertEqual(try server.requests().count, 1)
        assertNothingLoadable()
    }

    func testInterruptedDownloadResumesWithARangeRequest() async throws {
        let files = Self.bundleFiles(seed: 9)
        try writeBundle(files)
        let server = try startServer(["--drop-once", "f16/" + Self.bigFile, "--drop-after", "10000"])
        let size = Int64(files[Self.bigFile]!.count)
        let error = await downloadError(server)
        XCTAssertEqual(error, .truncated(path: Self.bigFile, received: 10000, expected: size))
        assertNothingLoadable()
        let part = BundleDownloader.stagingFolder(for: destination).appendingPathComponent(Self.bigFile + ".part")
        XCTAssertEqual(BundleDownloader.fileSize(part), 10000)

        try await downloader(server).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination).filter { $0.key != "manifest.json" }, files)
        let log = try server.requests()
        let big = log.filter { $0.path.hasSuffix("/f16/" + Self.bigFile) }
        XCTAssertEqual(big.map(\.range), [nil, "bytes=10000-"])
        XCTAssertEqual(big.last?.status, 206)
        // Files verified in the first run are not fetched again.
        for path in files.keys where path != Self.bigFile && !files[path]!.isEmpty {
            XCTAssertEqual(log.filter { $0.path.hasSuffix("/f16/" + path) }.count, 1, path)
        }
    }

    func testResumeStartsOverWhenTheServerIgnoresRange() async throws {
        let files = Self.bundleFiles(seed: 10)
        try writeBundle(files)
        let first = try startServer(["--drop-once", "f16/" + Self.bigFile, "--drop-after", "7000"])
        let error = await downloadError(first)
        XCTAssertEqual(error, .truncated(path: Self.bigFile, received: 7000, expected: Int64(files[Self.bigFile]!.count)))
        let second = try startServer(["--no-range"])
        try await downloader(second).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination).filter { $0.key != "manifest.json" }, files)
        let big = try second.requests().filter { $0.path.hasSuffix("/f16/" + Self.bigFile) }
        XCTAssertEqual(big.map(\.range), ["bytes=7000-"])
        XCTAssertEqual(big.map(\.status), [200])
    }

    func testResumedPrefixOfAnotherVersionIsDiscarded() async throws {
        // A .part left from an older upload: the resumed file fails its hash once, then comes whole.
        let files = Self.bundleFiles(seed: 11)
        try writeBundle(files)
        let part = BundleDownloader.stagingFolder(for: destination).appendingPathComponent(Self.bigFile + ".part")
        try FileManager.default.createDirectory(at: part.deletingLastPathComponent(), withIntermediateDirectories: true)
        try Data(repeating: 0x55, count: 5000).write(to: part)
        let server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination).filter { $0.key != "manifest.json" }, files)
        let big = try server.requests().filter { $0.path.hasSuffix("/f16/" + Self.bigFile) }
        XCTAssertEqual(big.map(\.range), ["bytes=5000-", nil])
    }

    func testExistingDestinationIsUntouchedWhenALaterDownloadFails() async throws {
        let v1 = Self.bundleFiles(seed: 12)
        try writeBundle(v1)
        var server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        let good = try tree(destination)
        server.stop()

        var v2 = Self.bundleFiles(seed: 13)
        v2["vocab.json"] = Data("{\"0\": \"<unk>\", \"1\": \"new\"}".utf8)
        try FileManager.default.removeItem(at: root.appendingPathComponent("f16"))
        try writeBundle(v2)
        for fault in ["--flip", "--missing", "--truncate"] {
            server = try startServer([fault, "f16/" + Self.bigFile])
            let error = await downloadError(server)
            XCTAssertNotNil(error, fault)
            XCTAssertTrue(error?.description.contains(Self.bigFile) ?? false, "\(fault): \(String(describing: error))")
            XCTAssertEqual(try tree(destination), good, fault)
            XCTAssertNoThrow(try BundleDownloader.verify(bundle: destination), fault)
            server.stop()
        }
    }

    func testUpdateReplacesTheDestinationWithExactlyTheNewVersion() async throws {
        var v1 = Self.bundleFiles(seed: 14)
        v1["old-only.json"] = Data("{}".utf8)
        try writeBundle(v1)
        var server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        server.stop()

        var v2 = Self.bundleFiles(seed: 15)
        v2["new-only.json"] = Data("[1, 2]".utf8)
        try FileManager.default.removeItem(at: root.appendingPathComponent("f16"))
        let manifest = try writeBundle(v2)
        server = try startServer()
        try await downloader(server).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination), v2.merging(["manifest.json": manifest]) { a, _ in a })
        XCTAssertEqual(try leftovers(), [])
    }

    func testCancellationStopsMidFileAndLeavesNothingLoadable() async throws {
        var files = Self.bundleFiles(seed: 16)
        let slow = "decoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        files[slow] = Data((0..<160_000).map { UInt8(truncatingIfNeeded: $0 &* 31) })   // 160 pieces, 20 ms apart
        try writeBundle(files)
        let server = try startServer(["--slow", "f16/" + slow])
        let started = Box(false)
        let client = downloader(server)
        let destination = self.destination!
        let task = Task { () -> DownloadError? in
            do {
                try await client.download(folder: "f16", to: destination) { p in
                    if p.currentFile == slow { started.mutate { $0 = true } }
                }
                return nil
            } catch {
                return error as? DownloadError
            }
        }
        let deadline = Date().addingTimeInterval(20)
        while !started.value && Date() < deadline { try await Task.sleep(nanoseconds: 10_000_000) }
        XCTAssertTrue(started.value)
        try await Task.sleep(nanoseconds: 200_000_000)
        let cancelledAt = Date()
        task.cancel()
        let error = await task.value
        XCTAssertEqual(error, .cancelled)
        XCTAssertLessThan(Date().timeIntervalSince(cancelledAt), 2.0, "the transfer was not interrupted")
        assertNothingLoadable()
        // The slow file is not complete in staging.
        let staged = BundleDownloader.stagingFolder(for: destination).appendingPathComponent(slow)
        XCTAssertFalse(FileManager.default.fileExists(atPath: staged.path))
        XCTAssertLessThan(BundleDownloader.fileSize(staged.appendingPathExtension("part")) ?? 0, 160_000)
    }

    func testTokenIsSentAndNeverInAnError() async throws {
        let files = Self.bundleFiles(seed: 17)
        try writeBundle(files)
        let token = "hf_secret_\(UUID().uuidString)"
        let server = try startServer(["--token", token])
        let error = await downloadError(server)
        guard case .httpStatus(_, 401)? = error else { return XCTFail("\(String(describing: error))") }
        let wrong = "hf_wrong_\(UUID().uuidString)"
        let wrongError = await downloadError(server, token: wrong)
        guard case .httpStatus(_, 401)? = wrongError else { return XCTFail("\(String(describing: wrongError))") }
        XCTAssertFalse(wrongError!.description.contains(wrong))
        XCTAssertFalse(String(describing: downloader(server, token: wrong)).contains(wrong))
        assertNothingLoadable()
        let before = try server.requests().count
        try await downloader(server, token: token).download(folder: "f16", to: destination)
        XCTAssertEqual(try tree(destination).filter { $0.key != "manifest.json" }, files)
        XCTAssertTrue(try server.requests().dropFirst(before).allSatisfy { $0.auth && $0.status < 400 })
    }

    func testPathRulesAndChecksumTable() throws {
        for bad in ["", "/a", "../a", "a/..", "a/../b", ".", "./a", "a/.", "a//b", "a/", "a\\b", "a\u{0}b", "e\u{301}.bin"] {
            XCTAssertNotNil(BundlePath.unsafeReason(bad), bad)
        }
        for good in ["a", "encoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin", ".hidden", "a..b", "\u{e9}.bin", "a b"] {
            XCTAssertNil(BundlePath.unsafeReason(good), good)
        }
        func parse(_ checksums: Any) throws -> ChecksumTable {
            try ChecksumTable.parse(JSONSerialization.data(withJSONObject: ["checksums": checksums]), source: "m")
        }
        let h = String(repeating: "ab", count: 32)
        let table = try parse(["algorithm": "sha256", "total_bytes": 5,
                               "files": ["b": ["sha256": h, "size": 3], "a/c": ["sha256": h.uppercased(), "size": 2]]])
        XCTAssertEqual(table.entries.map(\.path), ["a/c", "b"])
        XCTAssertEqual(table.totalBytes, 5)
        XCTAssertEqual(table.entries.first?.sha256, h)
        XCTAssertThrowsError(try parse(["algorithm": "sha256", "total_bytes": 6, "files": ["b": ["sha256": h, "size": 5]]]))
        XCTAssertThrowsError(try parse(["algorithm": "md5", "files": ["b": ["sha256": h, "size": 5]]])) {
            guard case .noChecksums? = $0 as? DownloadError else { return XCTFail("\($0)") }
        }
        XCTAssertThrowsError(try parse(["algorithm": "sha256", "files": ["b": ["sha256": "12", "size": 5]]]))
        XCTAssertThrowsError(try parse(["algorithm": "sha256", "files": ["b": ["sha256": h, "size": -1]]]))
        XCTAssertThrowsError(try parse(["algorithm": "sha256", "files": ["a": ["sha256": h, "size": 1],
                                                                         "a/b": ["sha256": h, "size": 1]]])) {
            XCTAssertEqual(($0 as? DownloadError).flatMap { if case .unsafePath(let p, _) = $0 { return p } else { return nil } }, "a/b")
        }
        XCTAssertThrowsError(try parse(["algorithm": "sha256", "files": ["A.bin": ["sha256": h, "size": 1],
                                                                         "a.bin": ["sha256": h, "size": 1]]]))
        XCTAssertThrowsError(try parse(["algorithm": "sha256", "files": ["manifest.json": ["sha256": h, "size": 1]]]))
    }

    func testDefaultDestinationAndURLs() throws {
        let url = try BundleDownloader.defaultDestination(repoId: "org/model", revision: "main", folder: "q8")
        let support = FileManager.default.urls(for: .applicationSupportDirectory, in: .userDomainMask)[0]
        XCTAssertEqual(url.path, support.appendingPathComponent("CohereTranscribe/org__model/main/q8").path)
        XCTAssertThrowsError(try BundleDownloader.defaultDestination(repoId: "org/../x", folder: "q8"))
        XCTAssertThrowsError(try BundleDownloader.defaultDestination(repoId: "org/model", folder: "../q8"))
        let d = BundleDownloader(repoId: "org/model", revision: "refs/pr/1", endpoint: URL(string: "http://h:1/")!)
        XCTAssertEqual(d.fileURL(folder: "q8", path: "a b/c#d.bin").absoluteString,
                       "http://h:1/org/model/resolve/refs%2Fpr%2F1/q8/a%20b/c%23d.bin")
    }

    // MARK: - Helpers

    func downloader(_ server: HubTestServer, token: String? = nil) -> BundleDownloader {
        BundleDownloader(repoId: Self.repoId, endpoint: URL(string: "http://127.0.0.1:\(server.port)")!, token: token,
                         timeout: 20)
    }

    func downloadError(_ server: HubTestServer, token: String? = nil) async -> DownloadError? {
        do {
            let url = try await downloader(server, token: token).download(folder: "f16", to: destination)
            XCTFail("expected an error, downloaded \(url.path)")
            return nil
        } catch let error as DownloadError {
            return error
        } catch {
            XCTFail("not a DownloadError: \(error)")
            return nil
        }
    }

    func startServer(_ arguments: [String] = []) throws -> HubTestServer {
        let server = try HubTestServer(root: root, log: work.appendingPathComponent("requests-\(servers.count).jsonl"),
                                       arguments: ["--repo-id", Self.repoId, "--commit", Self.commit] + arguments)
        servers.append(server)
        return server
    }

    /// Nothing `BundleManifest.load` or a caller could take for a bundle: no destination folder, or one without manifest.json.
    func assertNothingLoadable(file: StaticString = #filePath, line: UInt = #line) {
        let fm = FileManager.default
        XCTAssertFalse(fm.fileExists(atPath: destination.appendingPathComponent("manifest.json").path), file: file, line: line)
        XCTAssertThrowsError(try BundleManifest.load(bundle: destination), file: file, line: line)
        let staging = BundleDownloader.stagingFolder(for: destination)
        XCTAssertFalse(fm.fileExists(atPath: staging.appendingPathComponent("manifest.json").path), file: file, line: line)
    }

    /// A few files shaped like a bundle: nested package files, an empty file, a name with a space.
    static func bundleFiles(seed: UInt64) -> [String: Data] {
        var generator = SplitMix64(seed: seed)
        func bytes(_ n: Int) -> Data { Data((0..<n).map { _ in UInt8(truncatingIfNeeded: generator.next()) }) }
        return [
            "encoder.mlpackage/Manifest.json": Data("{\"fileFormatVersion\": \"1.0.0\", \"seed\": \(seed)}".utf8),
            "encoder.mlpackage/Data/com.apple.CoreML/model.mlmodel": bytes(3000),
            bigFile: bytes(65_536 + 123),
            "decoder.mlpackage/Manifest.json": Data("{\"fileFormatVersion\": \"1.0.0\"}".utf8),
            "decoder.mlpackage/Data/com.apple.CoreML/model.mlmodel": bytes(2500),
            "decoder.mlpackage/Data/com.apple.CoreML/weights/weight.bin": bytes(20_000),
            "vocab.json": Data("{\"0\": \"<unk>\", \"1\": \"\u{2581}a\"}".utf8),
            "empty.json": Data(),
            "model card.md": bytes(1500),
        ]
    }

    static func checksums(_ files: [String: Data]) -> [String: Any] {
        ["algorithm": "sha256",
         "files": files.mapValues { ["sha256": SHA256.hexDigest($0), "size": $0.count] as [String: Any] },
         "total_bytes": files.values.reduce(0) { $0 + $1.count }]
    }

    /// Writes `files` under `<root>/f16` and a manifest whose checksums SHA256.swift computed; returns the manifest bytes.
    @discardableResult
    func writeBundle(_ files: [String: Data]) throws -> Data {
        let folder = root.appendingPathComponent("f16")
        for (path, data) in files {
            let url = folder.appendingPathComponent(path)
            try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
            try data.write(to: url)
        }
        return try writeManifest(checksums: Self.checksums(files))
    }

    @discardableResult
    func writeManifest(checksums: [String: Any]?) throws -> Data {
        var manifest: [String: Any] = ["format": BundleManifest.formatName, "format_version": 1, "preset": "f16"]
        if let checksums { manifest["checksums"] = checksums }
        let data = try JSONSerialization.data(withJSONObject: manifest, options: [.sortedKeys])
        let url = root.appendingPathComponent("f16/manifest.json")
        try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
        try data.write(to: url)
        return data
    }

    /// Every regular file under `url`, by relative path.
    func tree(_ url: URL) throws -> [String: Data] {
        var out: [String: Data] = [:]
        let base = url.standardizedFileURL.path
        guard let e = FileManager.default.enumerator(atPath: base) else { return out }
        while let relative = e.nextObject() as? String {
            let full = base + "/" + relative
            var isDir: ObjCBool = false
            if FileManager.default.fileExists(atPath: full, isDirectory: &isDir), !isDir.boolValue {
                out[relative] = try Data(contentsOf: URL(fileURLWithPath: full))
            }
        }
        return out
    }

    /// Names beside the destination other than the destination itself (staging, moved-aside copies).
    func leftovers() throws -> [String] {
        try FileManager.default.contentsOfDirectory(atPath: destination.deletingLastPathComponent().path)
            .filter { $0 != destination.lastPathComponent }
    }

    func modificationDate(_ url: URL) throws -> Date {
        try XCTUnwrap(FileManager.default.attributesOfItem(atPath: url.path)[.modificationDate] as? Date)
    }
}

/// A lock-protected value shared with progress callbacks.
final class Box<T>: @unchecked Sendable {
    private let lock = NSLock()
    private var stored: T
    init(_ value: T) { stored = value }
    var value: T { lock.lock(); defer { lock.unlock() }; return stored }
    func mutate(_ body: (inout T) -> Void) { lock.lock(); defer { lock.unlock() }; body(&stored) }
}

/// tools/testing/hub_test_server.py in a child process (stopped by `stop()` or when the test process exits:
/// the server quits when its stdin closes). No child processes on iOS: there `init` skips the test.
final class HubTestServer {
    struct Request: Decodable {
        var path: String
        var range: String?
        var auth: Bool
        var status: Int
    }

    let port: Int
    let log: URL
    #if os(macOS) || os(Linux)
    private let process = Process()
    private let stdin = Pipe()
    #endif

    init(root: URL, log: URL, arguments: [String]) throws {
        #if os(macOS) || os(Linux)
        self.log = log
        let script = Fixtures.repoRoot.appendingPathComponent("tools/testing/hub_test_server.py")
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["python3", script.path, "--root", root.path, "--log", log.path] + arguments
        let stdout = Pipe()
        process.standardOutput = stdout
        process.standardInput = stdin
        try process.run()
        var line = Data()
        while true {
            let byte = stdout.fileHandleForReading.readData(ofLength: 1)
            if byte.isEmpty || byte == Data("\n".utf8) { break }
            line.append(byte)
        }
        guard let port = Int(String(decoding: line, as: UTF8.self)) else {
            process.terminate()
            throw DownloadError.invalidArgument("tools/testing/hub_test_server.py did not print its port (python3 missing?)")
        }
        self.port = port
        #else
        throw XCTSkip("the test hub server \(Fixtures.noChildProcesses)")
        #endif
    }

    func requests() throws -> [Request] {
        guard let text = try? String(contentsOf: log, encoding: .utf8) else { return [] }
        return try text.split(separator: "\n").map { try JSONDecoder().decode(Request.self, from: Data($0.utf8)) }
    }

    func stop() {
        #if os(macOS) || os(Linux)
        guard process.isRunning else { return }
        process.terminate()
        try? stdin.fileHandleForWriting.close()
        process.waitUntilExit()
        #endif
    }
}
