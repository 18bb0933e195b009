import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
#if canImport(os)
import os
#endif

/// A download that failed. Every case names what failed (the URL, or the file's path inside the
/// bundle as the manifest lists it); none carries the access token.
public enum DownloadError: Error, Equatable, CustomStringConvertible, LocalizedError {
    /// The server answered `status` (404, 401, ...) for `url`.
    case httpStatus(url: String, status: Int)
    /// The body of `path` ended after `received` of `expected` bytes (the `.part` file is kept for resume).
    case truncated(path: String, received: Int64, expected: Int64)
    /// `path` has `size` bytes (when the server sends more: at least `size`), the manifest says `expected`.
    case sizeMismatch(path: String, size: Int64, expected: Int64)
    /// The SHA-256 of `path` is `sha256`, the manifest says `expected`.
    case hashMismatch(path: String, sha256: String, expected: String)
    /// The manifest lists `path`, which would leave the bundle folder or is not a plain relative path.
    case unsafePath(path: String, reason: String)
    /// The manifest at `url` has no usable `checksums` section (nothing could be verified).
    case noChecksums(url: String, reason: String)
    /// The manifest at `url` is not a JSON object or its `checksums` section is inconsistent.
    case invalidManifest(url: String, reason: String)
    /// The request for `url` failed before any byte of the body arrived (connection refused, DNS, TLS, ...).
    case network(url: String, message: String)
    /// A file system operation on `path` failed.
    case fileSystem(path: String, message: String)
    /// An argument (repository id, folder, revision) is not usable.
    case invalidArgument(String)
    /// The task was cancelled.
    case cancelled

    public var description: String {
        switch self {
        case .httpStatus(let url, let status):
            return "HTTP \(status) for \(url)" + (status == 401 || status == 403 ? " (gated or private repository: pass a token)" : "")
        case .truncated(let path, let received, let expected):
            return "download of \(path) ended after \(received) of \(expected) bytes (run again to resume)"
        case .sizeMismatch(let path, let size, let expected):
            return "\(path) has \(size) bytes, the manifest says \(expected)"
        case .hashMismatch(let path, let sha256, let expected):
            return "\(path) has sha256 \(sha256), the manifest says \(expected)"
        case .unsafePath(let path, let reason):
            return "the manifest lists an unsafe path '\(path)': \(reason)"
        case .noChecksums(let url, let reason):
            return "the manifest at \(url) has no checksums (\(reason)): re-export the bundle with a current cohere-coreml"
        case .invalidManifest(let url, let reason):
            return "invalid manifest at \(url): \(reason)"
        case .network(let url, let message):
            return "request for \(url) failed: \(message)"
        case .fileSystem(let path, let message):
            return "\(path): \(message)"
        case .invalidArgument(let s):
            return s
        case .cancelled:
            return "download cancelled"
        }
    }

    public var errorDescription: String? { description }
}

/// Where a download stands: bytes verified or received so far out of the manifest's `total_bytes`.
public struct DownloadProgress: Sendable, Equatable {
    /// Bytes of the bundle's files done so far (verified files plus the current file's bytes).
    public var bytesDone: Int64
    /// `checksums.total_bytes` of the manifest (every file but manifest.json).
    public var totalBytes: Int64
    /// The file being downloaded or checked (its path inside the bundle), nil before the first and after the last.
    public var currentFile: String?

    public init(bytesDone: Int64, totalBytes: Int64, currentFile: String?) {
        self.bytesDone = bytesDone
        self.totalBytes = totalBytes
        self.currentFile = currentFile
    }

    /// `bytesDone / totalBytes` (1 for an empty bundle).
    public var fraction: Double { totalBytes > 0 ? Double(bytesDone) / Double(totalBytes) : 1 }
}

/// Downloads one preset folder (`f16`, `q8`, ...) of a Hugging Face Hub model repository into a
/// local bundle folder, verifying every file against the manifest's `checksums` (docs/bundle.md).
///
/// ```swift
/// let downloader = BundleDownloader(repoId: "org/cohere-transcribe-coreml")
/// let bundle = try await downloader.download(folder: "q8") { p in print(p.fraction) }
/// let transcriber = try await CohereTranscriber(bundle: bundle)
/// ```
///
/// Files are fetched from `<endpoint>/<repoId>/resolve/<revision>/<folder>/<path>` into a hidden
/// staging folder beside the destination (`.<name>.partial`), each as `<path>.part` (resumed with an
/// HTTP Range request when one is left from an interrupted run), checked for size and SHA-256, then
/// renamed into place. `manifest.json` is written last and the staging folder is then moved to the
/// destination, replacing an existing one only when everything verified. A failed or cancelled
/// download never leaves a folder with a `manifest.json` at the destination (an existing bundle
/// there stays as it was).
public final class BundleDownloader: Sendable {
    /// `https://huggingface.co`.
    public static let defaultEndpoint = URL(string: "https://huggingface.co")!

    /// The Hub repository, `owner/name`.
    public let repoId: String
    /// Branch, tag or commit to download (`main`).
    public let revision: String
    /// The Hub's base URL (a local server in tests).
    public let endpoint: URL
    /// Seconds a request may wait for data before it fails.
    public let timeout: TimeInterval
    private let token: String?

    /// A downloader for `repoId` at `revision`. `token` (a Hugging Face access token, for gated or
    /// private repositories) is sent as a bearer token to the endpoint's host only, never logged and
    /// never part of an error.
    public init(repoId: String, revision: String = "main", endpoint: URL = BundleDownloader.defaultEndpoint,
                token: String? = nil, timeout: TimeInterval = 60) {
        self.repoId = repoId
        self.revision = revision
        self.endpoint = endpoint
        self.token = token.flatMap { $0.isEmpty ? nil : $0 }
        self.timeout = timeout
    }

    /// `Application Support/CohereTranscribe/<repoId with / as __>/<revision>/<folder>`.
    public static func defaultDestination(repoId: String, revision: String = "main", folder: String) throws -> URL {
        try checkArguments(repoId: repoId, revision: revision, folder: folder)
        guard let support = FileManager.default.urls(for: .applicationSupportDirectory, in: .userDomainMask).first else {
            throw DownloadError.fileSystem(path: "Application Support", message: "no Application Support folder")
        }
        return support.appendingPathComponent("CohereTranscribe", isDirectory: true)
            .appendingPathComponent(repoId.replacingOccurrences(of: "/", with: "__"), isDirectory: true)
            .appendingPathComponent(revision.replacingOccurrences(of: "/", with: "__"), isDirectory: true)
            .appendingPathComponent(folder, isDirectory: true)
    }

    /// The Hub URL of `path` inside `folder` at `revision` (default: this downloader's).
    public func fileURL(folder: String, path: String, revision: String? = nil) -> URL {
        var url = endpoint
        for component in repoId.split(separator: "/") { url = url.appendingPathComponent(String(component)) }
        url = url.appendingPathComponent("resolve")
        var s = url.absoluteString
        if s.hasSuffix("/") { s.removeLast() }
        s += "/" + Self.encodeComponent(revision ?? self.revision)
        for component in (folder + "/" + path).split(separator: "/") {
            s += "/" + Self.encodeComponent(String(component))
        }
        return URL(string: s)!
    }

    /// Downloads `folder` of the repository into `destination` (default: `defaultDestination`) and
    /// returns the bundle folder. A destination that already holds the same manifest.json with every
    /// listed file at its listed size is kept as is (no file is downloaded; `verify(bundle:)` re-hashes).
    ///
    /// `progress` is called from a background queue: at the start of every file, about every MiB,
    /// and with `bytesDone == totalBytes` and `currentFile == nil` at the end.
    @discardableResult
    public func download(folder: String, to destination: URL? = nil,
                         progress: (@Sendable (DownloadProgress) -> Void)? = nil) async throws -> URL {
        try Self.checkArguments(repoId: repoId, revision: revision, folder: folder)
        let destination = try destination ?? Self.defaultDestination(repoId: repoId, revision: revision, folder: folder)
        do {
            return try await run(folder: folder, destination: destination.standardizedFileURL, progress: progress)
        } catch is CancellationError {
            throw DownloadError.cancelled
        } catch let error as URLError where error.code == .cancelled {
            throw DownloadError.cancelled
        }
    }

    /// Re-hashes every file of a bundle folder against its manifest's `checksums` (all sizes first,
    /// then SHA-256). Throws the first `DownloadError` found (naming the file).
    public static func verify(bundle: URL) throws {
        let manifestURL = bundle.appendingPathComponent(BundleManifest.fileName)
        let data: Data
        do { data = try Data(contentsOf: manifestURL) } catch {
            throw DownloadError.fileSystem(path: manifestURL.path, message: "cannot read: \(error.localizedDescription)")
        }
        let table = try ChecksumTable.parse(data, source: manifestURL.path)
        for entry in table.entries {
            let url = bundle.appendingPathComponent(entry.path)
            let size = fileSize(url)
            guard let size else { throw DownloadError.fileSystem(path: entry.path, message: "missing in \(bundle.path)") }
            guard size == entry.size else { throw DownloadError.sizeMismatch(path: entry.path, size: size, expected: entry.size) }
        }
        for entry in table.entries {
            let digest = try hexDigest(bundle.appendingPathComponent(entry.path), path: entry.path)
            guard digest == entry.sha256 else {
                throw DownloadError.hashMismatch(path: entry.path, sha256: digest, expected: entry.sha256)
            }
        }
    }

    // MARK: - The download

    /// Name of the copy of the manifest being downloaded, kept in the staging folder (never `manifest.json`).
    static let pendingManifestName = ".pending-manifest.json"

    /// The staging folder of `destination`: hidden, beside it (same volume, so the final move is a rename).
    public static func stagingFolder(for destination: URL) -> URL {
        destination.deletingLastPathComponent().appendingPathComponent(".\(destination.lastPathComponent).partial",
                                                                       isDirectory: true)
    }

    private func run(folder: String, destination: URL,
                     progress: (@Sendable (DownloadProgress) -> Void)?) async throws -> URL {
        let fm = FileManager.default
        try Task.checkCancellation()

        // 1. The manifest, and its checksums: every path checked before any file is requested.
        let manifestURL = fileURL(folder: folder, path: BundleManifest.fileName)
        let (manifestData, response) = try await fetchData(manifestURL, limit: 64 << 20)
        let table = try ChecksumTable.parse(manifestData, source: manifestURL.absoluteString)
        // Pin the rest of the download to the commit the manifest came from (the Hub sends it), so a
        // push to the branch meanwhile cannot mix two versions.
        var fileRevision = revision
        if let commit = Self.header(response, "X-Repo-Commit"), commit.utf8.count == 40, isASCIIHex(commit) {
            fileRevision = commit
        }
        Self.log("\(repoId)/\(folder)@\(fileRevision): \(table.entries.count) files, \(table.totalBytes) bytes")

        // 2. Up to date already?
        if let existing = try? Data(contentsOf: destination.appendingPathComponent(BundleManifest.fileName)),
           existing == manifestData,
           table.entries.allSatisfy({ Self.fileSize(destination.appendingPathComponent($0.path)) == $0.size }) {
            progress?(DownloadProgress(bytesDone: table.totalBytes, totalBytes: table.totalBytes, currentFile: nil))
            return destination
        }

        // 3. The staging folder; .part files of entries whose content changed since the last run are dropped.
        let staging = Self.stagingFolder(for: destination)
        try Self.fs(staging.path) { try fm.createDirectory(at: staging, withIntermediateDirectories: true) }
        try? fm.removeItem(at: staging.appendingPathComponent(BundleManifest.fileName))
        let pendingURL = staging.appendingPathComponent(Self.pendingManifestName)
        if let previous = try? Data(contentsOf: pendingURL), previous != manifestData {
            let old = (try? ChecksumTable.parse(previous, source: pendingURL.path))?.byPath ?? [:]
            for entry in table.entries where old[entry.path] != entry {
                try? fm.removeItem(at: staging.appendingPathComponent(entry.path + ".part"))
            }
        }
        try Self.fs(pendingURL.path) { try manifestData.write(to: pendingURL, options: .atomic) }

        // 4. Every file, verified before it is renamed into place.
        var done: Int64 = 0
        for entry in table.entries {
            try Task.checkCancellation()
            progress?(DownloadProgress(bytesDone: done, totalBytes: table.totalBytes, currentFile: entry.path))
            try await fetchFile(entry, folder: folder, revision: fileRevision, staging: staging,
                                done: done, total: table.totalBytes, progress: progress)
            done += entry.size
            progress?(DownloadProgress(bytesDone: done, totalBytes: table.totalBytes, currentFile: entry.path))
        }
        try Task.checkCancellation()

        // 5. Only the listed files stay; manifest.json last; then the whole folder moves into place.
        try Self.removeUnlisted(in: staging, keeping: table)
        let stagedManifest = staging.appendingPathComponent(BundleManifest.fileName)
        try Self.fs(stagedManifest.path) { try manifestData.write(to: stagedManifest, options: .atomic) }
        try Task.checkCancellation()
        do {
            try Self.moveIntoPlace(staging, destination)
        } catch {
            try? fm.removeItem(at: stagedManifest)
            throw error
        }
        #if canImport(Darwin)
        // Re-downloadable GBs: not for the device backup (Apple's storage guidelines).
        var values = URLResourceValues()
        values.isExcludedFromBackup = true
        var bundleURL = destination
        try? bundleURL.setResourceValues(values)
        #endif
        progress?(DownloadProgress(bytesDone: table.totalBytes, totalBytes: table.totalBytes, currentFile: nil))
        Self.log("\(repoId)/\(folder): done")
        return destination
    }

    /// Makes `staging/<entry.path>` a verified copy: kept when already there and intact, else
    /// downloaded as `.part` (resumed when one exists), checked, renamed.
    private func fetchFile(_ entry: ChecksumTable.Entry, folder: String, revision: String, staging: URL,
                           done: Int64, total: Int64,
                           progress: (@Sendable (DownloadProgress) -> Void)?) async throws {
        let fm = FileManager.default
        let final = staging.appendingPathComponent(entry.path)
        let part = staging.appendingPathComponent(entry.path + ".part")
        if let size = Self.fileSize(final) {
            if size == entry.size, try Self.hexDigest(final, path: entry.path) == entry.sha256 { return }
            try Self.fs(final.path) { try fm.removeItem(at: final) }
        }
        try Self.fs(final.deletingLastPathComponent().path) {
            try fm.createDirectory(at: final.deletingLastPathComponent(), withIntermediateDirectories: true)
        }
        let url = fileURL(folder: folder, path: entry.path, revision: revision)
        var allowResume = true
        while true {
            var offset = Self.fileSize(part) ?? 0
            if offset > entry.size || (offset > 0 && !allowResume) {
                try Self.fs(part.path) { try fm.removeItem(at: part) }
                offset = 0
            }
            let sink = try FileSink(url: part, path: entry.path, expected: entry.size, append: offset > 0)
            if offset < entry.size {
                if offset > 0 { Self.log("resuming \(entry.path) at byte \(offset)") }
                do {
                    try await transfer(url, path: entry.path, offset: offset, sink: sink) { written in
                        progress?(DownloadProgress(bytesDone: done + written, totalBytes: total, currentFile: entry.path))
                    }
                } catch TransferSignal.bodyBrokeOff {
                    // The connection broke off: the .part is kept for the next run to resume.
                    try? sink.close()
                    throw DownloadError.truncated(path: entry.path, received: sink.written, expected: entry.size)
                } catch TransferSignal.unexpectedRange {
                    try? sink.close()
                    allowResume = false
                    continue
                } catch let error as DownloadError {
                    try? sink.close()
                    if case .sizeMismatch = error { try? fm.removeItem(at: part) }
                    throw error
                }
            }
            try sink.close()
            if sink.written < entry.size {
                // A complete response of another size: another file than the manifest's.
                try? fm.removeItem(at: part)
                throw DownloadError.sizeMismatch(path: entry.path, size: sink.written, expected: entry.size)
            }
            let digest = sink.digest
            if digest != entry.sha256 {
                try? fm.removeItem(at: part)
                if offset > 0 && allowResume {
                    // The kept prefix may be from another version of the file: once more from the start.
                    allowResume = false
                    continue
                }
                throw DownloadError.hashMismatch(path: entry.path, sha256: digest, expected: entry.sha256)
            }
            try Self.fs(final.path) { try fm.moveItem(at: part, to: final) }
            return
        }
    }

    // MARK: - HTTP

    private func request(_ url: URL, offset: Int64 = 0) -> URLRequest {
        var request = URLRequest(url: url, cachePolicy: .reloadIgnoringLocalCacheData, timeoutInterval: timeout)
        request.setValue("identity", forHTTPHeaderField: "Accept-Encoding")
        request.setValue("cohere-transcribe-swift", forHTTPHeaderField: "User-Agent")
        if let token { request.setValue("Bearer \(token)", forHTTPHeaderField: "Authorization") }
        if offset > 0 { request.setValue("bytes=\(offset)-", forHTTPHeaderField: "Range") }
        return request
    }

    private func makeSession(_ delegate: TransferDelegate) -> URLSession {
        let configuration = URLSessionConfiguration.ephemeral
        configuration.urlCache = nil
        configuration.requestCachePolicy = .reloadIgnoringLocalCacheData
        configuration.timeoutIntervalForRequest = timeout
        let queue = OperationQueue()
        queue.maxConcurrentOperationCount = 1
        return URLSession(configuration: configuration, delegate: delegate, delegateQueue: queue)
    }

    /// GETs `url` into memory (at most `limit` bytes), refusing any status but 200.
    private func fetchData(_ url: URL, limit: Int) async throws -> (Data, HTTPURLResponse) {
        let buffer = MemorySink(limit: limit, url: url)
        let delegate = TransferDelegate(url: url, path: url.lastPathComponent, resumeOffset: 0, sink: buffer,
                                        endpointHost: endpoint.host, onBytes: nil)
        let response: HTTPURLResponse
        do {
            response = try await perform(delegate, request(url))
        } catch TransferSignal.bodyBrokeOff {
            throw DownloadError.network(url: url.absoluteString, message: "the body broke off")
        }
        let length = response.expectedContentLength
        if length >= 0 && length != buffer.written {
            throw DownloadError.network(url: url.absoluteString,
                                        message: "the body has \(buffer.written) of \(length) bytes")
        }
        return (buffer.data, response)
    }

    /// GETs `url` into `sink` from `offset` (a Range request when > 0: a 206 appends, a 200 restarts).
    private func transfer(_ url: URL, path: String, offset: Int64, sink: FileSink,
                          onBytes: @escaping @Sendable (Int64) -> Void) async throws {
        let delegate = TransferDelegate(url: url, path: path, resumeOffset: offset, sink: sink,
                                        endpointHost: endpoint.host, onBytes: onBytes)
        _ = try await perform(delegate, request(url, offset: offset))
    }

    private func perform(_ delegate: TransferDelegate, _ request: URLRequest) async throws -> HTTPURLResponse {
        let session = makeSession(delegate)
        defer { session.finishTasksAndInvalidate() }
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                delegate.start(session: session, request: request, continuation: continuation)
            }
        } onCancel: {
            delegate.cancel()
        }
    }

    static func header(_ response: HTTPURLResponse, _ name: String) -> String? {
        for (key, value) in response.allHeaderFields {
            if let key = key as? String, key.caseInsensitiveCompare(name) == .orderedSame { return value as? String }
        }
        return nil
    }

    // MARK: - Paths and files

    private static let componentAllowed: CharacterSet = {
        var set = CharacterSet.urlPathAllowed
        set.remove(charactersIn: "/;?#%")
        return set
    }()

    private static func encodeComponent(_ s: String) -> String {
        s.addingPercentEncoding(withAllowedCharacters: componentAllowed) ?? s
    }

    static func checkArguments(repoId: String, revision: String, folder: String) throws {
        let parts = repoId.split(separator: "/", omittingEmptySubsequences: false)
        let allowed = CharacterSet.alphanumerics.union(CharacterSet(charactersIn: "-_."))
        guard parts.count == 2, parts.allSatisfy({ !$0.isEmpty && $0 != "." && $0 != ".." &&
                String($0).unicodeScalars.allSatisfy { allowed.contains($0) } }) else {
            throw DownloadError.invalidArgument("repository id '\(repoId)' is not owner/name")
        }
        guard !revision.isEmpty, !revision.contains(".."), !revision.hasPrefix("/"),
              !revision.unicodeScalars.contains(where: { $0.value < 0x20 || $0 == "\\" }) else {
            throw DownloadError.invalidArgument("revision '\(revision)' is not a branch, tag or commit")
        }
        if let reason = BundlePath.unsafeReason(folder) {
            throw DownloadError.invalidArgument("folder '\(folder)' is not a relative path: \(reason)")
        }
    }

    private static func removeUnlisted(in staging: URL, keeping table: ChecksumTable) throws {
        var directories: Set<String> = []
        for entry in table.entries {
            var parts = entry.path.split(separator: "/").dropLast()
            while !parts.isEmpty {
                directories.insert(parts.joined(separator: "/"))
                parts = parts.dropLast()
            }
        }
        let files = Set(table.entries.map(\.path))
        let fm = FileManager.default
        func walk(_ url: URL, _ prefix: String) throws {
            let names = try fs(url.path) { try fm.contentsOfDirectory(atPath: url.path) }
            for name in names {
                let relative = prefix.isEmpty ? name : prefix + "/" + name
                let child = url.appendingPathComponent(name)
                if directories.contains(relative), isDirectory(child) {
                    try walk(child, relative)
                } else if !(files.contains(relative) && !isDirectory(child)) {
                    try fs(child.path) { try fm.removeItem(at: child) }
                }
            }
        }
        try walk(staging, "")
    }

    /// Renames `staging` to `destination`; an existing destination is moved aside first and deleted
    /// after, or put back when the rename fails.
    private static func moveIntoPlace(_ staging: URL, _ destination: URL) throws {
        let fm = FileManager.default
        if !fm.fileExists(atPath: destination.path) {
            try fs(destination.path) { try fm.moveItem(at: staging, to: destination) }
            return
        }
        let aside = destination.deletingLastPathComponent()
            .appendingPathComponent(".\(destination.lastPathComponent).old-\(UUID().uuidString)")
        try fs(destination.path) { try fm.moveItem(at: destination, to: aside) }
        do {
            try fs(destination.path) { try fm.moveItem(at: staging, to: destination) }
        } catch {
            try? fm.moveItem(at: aside, to: destination)
            throw error
        }
        try? fm.removeItem(at: aside)
    }

    static func fileSize(_ url: URL) -> Int64? {
        guard let attributes = try? FileManager.default.attributesOfItem(atPath: url.path),
              (attributes[.type] as? FileAttributeType) == .typeRegular,
              let size = attributes[.size] as? NSNumber else { return nil }
        return size.int64Value
    }

    private static func isDirectory(_ url: URL) -> Bool {
        var isDir: ObjCBool = false
        return FileManager.default.fileExists(atPath: url.path, isDirectory: &isDir) && isDir.boolValue
    }

    private static func hexDigest(_ url: URL, path: String) throws -> String {
        do { return try SHA256.hexDigest(ofFile: url) } catch {
            throw DownloadError.fileSystem(path: path, message: "cannot read: \(error.localizedDescription)")
        }
    }

    @discardableResult
    static func fs<T>(_ path: String, _ body: () throws -> T) throws -> T {
        do { return try body() } catch let error as DownloadError { throw error } catch {
            throw DownloadError.fileSystem(path: path, message: error.localizedDescription)
        }
    }

    static func log(_ message: String) {
        #if canImport(os)
        logger.info("\(message, privacy: .public)")
        #endif
    }

    #if canImport(os)
    private static let logger = Logger(subsystem: "CohereTranscribe", category: "download")
    #endif
}
