import Foundation

func isASCIIHex(_ s: String) -> Bool {
    s.utf8.allSatisfy { (0x30...0x39).contains($0) || (0x41...0x46).contains($0) || (0x61...0x66).contains($0) }
}

/// `checksums.files` of a manifest, every path checked (docs/bundle.md). Independent of
/// `BundleManifest`: only this section is read.
struct ChecksumTable {
    struct Entry: Equatable {
        var path: String
        var sha256: String
        var size: Int64
    }

    /// Sorted by path.
    var entries: [Entry]
    var totalBytes: Int64
    var byPath: [String: Entry] { Dictionary(uniqueKeysWithValues: entries.map { ($0.path, $0) }) }

    private struct Document: Decodable {
        var checksums: Section?
    }

    private struct Section: Decodable {
        var algorithm: String?
        var files: [String: RawEntry]?
        var total_bytes: Int64?
    }

    private struct RawEntry: Decodable {
        var sha256: String
        var size: Int64
    }

    static func parse(_ data: Data, source: String) throws -> ChecksumTable {
        guard (try? JSONSerialization.jsonObject(with: data)) is [String: Any] else {
            throw DownloadError.invalidManifest(url: source, reason: "not a JSON object")
        }
        let document: Document
        do {
            document = try JSONDecoder().decode(Document.self, from: data)
        } catch let error as DecodingError {
            let context: DecodingError.Context?
            switch error {
            case .typeMismatch(_, let c), .valueNotFound(_, let c), .dataCorrupted(let c): context = c
            case .keyNotFound(let key, let c):
                context = DecodingError.Context(codingPath: c.codingPath + [key], debugDescription: c.debugDescription)
            @unknown default: context = nil
            }
            let keys = context?.codingPath.map(\.stringValue) ?? []
            if keys.count <= 1 {
                throw DownloadError.noChecksums(url: source, reason: "'checksums' is not an object")
            }
            if keys.count <= 2 {
                throw DownloadError.noChecksums(url: source, reason: "'checksums.\(keys[1])' has the wrong type")
            }
            throw DownloadError.invalidManifest(
                url: source, reason: "checksums entry of '\(keys[2])' needs sha256 (a string) and size (an integer)")
        }
        guard let section = document.checksums else {
            throw DownloadError.noChecksums(url: source, reason: "no 'checksums' section")
        }
        guard let algorithm = section.algorithm, algorithm.lowercased() == "sha256" else {
            throw DownloadError.noChecksums(url: source, reason: "algorithm is not sha256")
        }
        guard let files = section.files, !files.isEmpty else {
            throw DownloadError.noChecksums(url: source, reason: "no 'checksums.files' table")
        }
        var entries: [Entry] = []
        var seen: [String: String] = [:]   // case-folded path -> path (a case-insensitive volume has one file for both)
        for path in files.keys.sorted() {
            if let reason = BundlePath.unsafeReason(path) {
                throw DownloadError.unsafePath(path: path, reason: reason)
            }
            if path == BundleManifest.fileName || path == BundleDownloader.pendingManifestName || path.hasSuffix(".part") {
                throw DownloadError.unsafePath(path: path, reason: "reserved name")
            }
            let folded = path.lowercased()
            if let other = seen[folded] {
                throw DownloadError.unsafePath(path: path, reason: "same name as '\(other)' on a case-insensitive volume")
            }
            seen[folded] = path
            let item = files[path]!
            guard item.sha256.utf8.count == 64, isASCIIHex(item.sha256), item.size >= 0 else {
                throw DownloadError.invalidManifest(url: source, reason: "checksums entry of '\(path)' needs sha256 (64 hex digits) and a size >= 0")
            }
            entries.append(Entry(path: path, sha256: item.sha256.lowercased(), size: item.size))
        }
        // A file may not also be a folder of another listed file.
        let paths = Set(entries.map(\.path))
        for entry in entries {
            var parts = entry.path.split(separator: "/").dropLast()
            while !parts.isEmpty {
                let prefix = parts.joined(separator: "/")
                if paths.contains(prefix) {
                    throw DownloadError.unsafePath(path: entry.path, reason: "'\(prefix)' is listed as a file")
                }
                parts = parts.dropLast()
            }
        }
        let sum = entries.reduce(Int64(0)) { $0 + $1.size }
        if let listed = section.total_bytes, listed != sum {
            throw DownloadError.invalidManifest(url: source, reason: "checksums.total_bytes \(listed) is not the sum of the sizes (\(sum))")
        }
        return ChecksumTable(entries: entries, totalBytes: sum)
    }
}
