import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// How a transfer ended short of an error the caller reports as is.
enum TransferSignal: Error {
    /// The connection closed or failed after some body bytes.
    case bodyBrokeOff
    /// A 206 for another range than the one asked for.
    case unexpectedRange
}

/// Where a transfer's body goes.
protocol TransferSink: AnyObject {
    /// Called once the response says the body starts at 0 although `offset` bytes were asked to be skipped.
    func restart() throws
    func write(_ data: Data) throws
    var written: Int64 { get }
}

/// Body into memory, at most `limit` bytes.
final class MemorySink: TransferSink {
    private(set) var data = Data()
    private let limit: Int
    private let url: URL
    init(limit: Int, url: URL) { self.limit = limit; self.url = url }
    func restart() throws { data.removeAll() }
    func write(_ chunk: Data) throws {
        guard data.count + chunk.count <= limit else {
            throw DownloadError.invalidManifest(url: url.absoluteString, reason: "larger than \(limit) bytes")
        }
        data.append(chunk)
    }
    var written: Int64 { Int64(data.count) }
}

/// Body appended to a `.part` file and hashed on the way; a resumed file's kept prefix is hashed first.
final class FileSink: TransferSink {
    private let url: URL
    private let path: String
    private let expected: Int64
    private var handle: FileHandle?
    private var hasher = SHA256()
    private(set) var written: Int64 = 0

    init(url: URL, path: String, expected: Int64, append: Bool) throws {
        self.url = url
        self.path = path
        self.expected = expected
        let fm = FileManager.default
        if append, fm.fileExists(atPath: url.path) {
            let read = try BundleDownloader.fs(url.path) { try FileHandle(forReadingFrom: url) }
            defer { try? read.close() }
            while let chunk = try BundleDownloader.fs(url.path, { try read.read(upToCount: 1 << 20) }), !chunk.isEmpty {
                hasher.update(chunk)
                written += Int64(chunk.count)
            }
        } else {
            _ = fm.createFile(atPath: url.path, contents: nil)
        }
        handle = try BundleDownloader.fs(url.path) { try FileHandle(forWritingTo: url) }
        try BundleDownloader.fs(url.path) { _ = try handle!.seekToEnd() }
    }

    func restart() throws {
        try BundleDownloader.fs(url.path) {
            try handle?.truncate(atOffset: 0)
            try handle?.seek(toOffset: 0)
        }
        hasher = SHA256()
        written = 0
    }

    func write(_ data: Data) throws {
        guard written + Int64(data.count) <= expected else {
            throw DownloadError.sizeMismatch(path: path, size: written + Int64(data.count), expected: expected)
        }
        try BundleDownloader.fs(url.path) { try handle?.write(contentsOf: data) }
        hasher.update(data)
        written += Int64(data.count)
    }

    func close() throws {
        if let handle {
            self.handle = nil
            try BundleDownloader.fs(url.path) {
                try handle.synchronize()
                try handle.close()
            }
        }
    }

    var digest: String { hasher.finalize().hexString }

    deinit { try? handle?.close() }
}

/// One GET on its own session: checks the status, feeds the body to a sink on the delegate queue,
/// and resumes the continuation once the task has completed (every body byte written by then).
final class TransferDelegate: NSObject, URLSessionDataDelegate, @unchecked Sendable {
    private let url: URL
    private let path: String
    private let resumeOffset: Int64
    private let sink: TransferSink
    private let endpointHost: String?
    private let onBytes: (@Sendable (Int64) -> Void)?

    private let lock = NSLock()
    private var task: URLSessionDataTask?
    private var continuation: CheckedContinuation<HTTPURLResponse, Error>?
    private var failure: Error?
    private var response: HTTPURLResponse?
    private var cancelled = false
    private var receivedInThisRequest: Int64 = 0
    private var lastReport: Int64 = 0

    init(url: URL, path: String, resumeOffset: Int64, sink: TransferSink, endpointHost: String?,
         onBytes: (@Sendable (Int64) -> Void)?) {
        self.url = url
        self.path = path
        self.resumeOffset = resumeOffset
        self.sink = sink
        self.endpointHost = endpointHost
        self.onBytes = onBytes
    }

    func start(session: URLSession, request: URLRequest, continuation: CheckedContinuation<HTTPURLResponse, Error>) {
        lock.lock()
        self.continuation = continuation
        if cancelled {
            self.continuation = nil
            lock.unlock()
            continuation.resume(throwing: DownloadError.cancelled)
            return
        }
        let task = session.dataTask(with: request)
        self.task = task
        lock.unlock()
        task.resume()
    }

    func cancel() {
        lock.lock()
        cancelled = true
        if failure == nil { failure = DownloadError.cancelled }
        let task = self.task
        lock.unlock()
        task?.cancel()
    }

    private func fail(_ error: Error, _ task: URLSessionTask) {
        lock.lock()
        if failure == nil { failure = error }
        lock.unlock()
        task.cancel()
    }

    private var hasFailed: Bool {
        lock.lock()
        defer { lock.unlock() }
        return failure != nil
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive response: URLResponse,
                    completionHandler: @escaping @Sendable (URLSession.ResponseDisposition) -> Void) {
        guard let http = response as? HTTPURLResponse else {
            fail(DownloadError.network(url: url.absoluteString, message: "not an HTTP response"), dataTask)
            completionHandler(.cancel)
            return
        }
        lock.lock()
        self.response = http
        lock.unlock()
        var ok = false
        if http.statusCode == 200 {
            ok = true
            if resumeOffset > 0 || sink.written > 0 {
                // The server ignored the Range header: the body is the whole file.
                do { try sink.restart() } catch { fail(error, dataTask); completionHandler(.cancel); return }
            }
        } else if http.statusCode == 416 && resumeOffset > 0 {
            // The file is no longer than the kept part: the caller starts the file over.
            fail(TransferSignal.unexpectedRange, dataTask)
            completionHandler(.cancel)
            return
        } else if http.statusCode == 206 && resumeOffset > 0 {
            let range = BundleDownloader.header(http, "Content-Range") ?? ""
            if range.hasPrefix("bytes \(resumeOffset)-") {
                ok = true
            } else {
                // A range we did not ask for: the caller starts the file over.
                fail(TransferSignal.unexpectedRange, dataTask)
                completionHandler(.cancel)
                return
            }
        }
        if !ok {
            fail(DownloadError.httpStatus(url: url.absoluteString, status: http.statusCode), dataTask)
            completionHandler(.cancel)
            return
        }
        completionHandler(.allow)
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive data: Data) {
        if hasFailed { return }
        do {
            try sink.write(data)
        } catch {
            fail(error, dataTask)
            return
        }
        lock.lock()
        receivedInThisRequest += Int64(data.count)
        let written = sink.written
        let report = written - lastReport >= 1 << 20
        if report { lastReport = written }
        lock.unlock()
        if report { onBytes?(written) }
    }

    func urlSession(_ session: URLSession, task: URLSessionTask, willPerformHTTPRedirection response: HTTPURLResponse,
                    newRequest request: URLRequest, completionHandler: @escaping @Sendable (URLRequest?) -> Void) {
        var request = request
        // The token is for the Hub only, not for the CDN the Hub redirects large files to.
        if request.url?.host != endpointHost {
            request.setValue(nil, forHTTPHeaderField: "Authorization")
        }
        completionHandler(request)
    }

    func urlSession(_ session: URLSession, task: URLSessionTask, didCompleteWithError error: Error?) {
        lock.lock()
        let continuation = self.continuation
        self.continuation = nil
        let failure = self.failure
        let response = self.response
        let received = receivedInThisRequest
        lock.unlock()
        guard let continuation else { return }
        if let failure {
            continuation.resume(throwing: failure)
        } else if let error {
            if received > 0 {
                // The body broke off: the caller sees fewer bytes than the manifest lists.
                continuation.resume(throwing: TransferSignal.bodyBrokeOff)
            } else {
                continuation.resume(throwing: DownloadError.network(url: url.absoluteString, message: error.localizedDescription))
            }
        } else if let response {
            continuation.resume(returning: response)
        } else {
            continuation.resume(throwing: DownloadError.network(url: url.absoluteString, message: "no response"))
        }
    }
}
