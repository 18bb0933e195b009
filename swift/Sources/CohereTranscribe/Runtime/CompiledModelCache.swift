// The compiled-model cache's folder rules, shared with Python (src/cohere_coreml/runtime/compiled_cache.py;
// docs/runtime.md, "Compiled-model cache"): install without ever deleting a complete model, last use,
// and upkeep (a package's earlier contents, a size cap, list / clear / prune). Foundation only.
#if os(macOS) || os(iOS) || os(Linux)
import Foundation
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// One folder of the cache: a compiled model (`complete`), or a temporary of an install or a removal.
public struct CompiledCacheEntry: Sendable, Equatable {
    public let url: URL
    /// The package name it was compiled from (`encoder`); "" when unknown.
    public let package: String
    public let complete: Bool
    /// Bytes of its files.
    public let size: Int
    /// The marker's modification time (complete entries), else the folder's.
    public let lastUsed: Date
    /// The source package's path recorded in the marker (nil: not recorded).
    public let source: String?
    /// A temporary's process (nil: an entry).
    public let pid: Int32?
}

/// A compiled-model cache folder and its rules:
/// - install: the compiled model is moved beside its target as `.<entry>.tmp-<pid>-<id>`, marked complete (a
///   `.complete` file naming the source package), renamed to the target. A complete target is kept (its name
///   says its content is the same) and the fresh copy dropped; only a target without the marker is moved aside
///   and removed. Nothing is deleted in place: a removed entry is first renamed to `.<entry>.trash-<pid>-<id>`.
/// - last use: a load served from the cache touches the marker.
/// - upkeep after an install: the entries compiled from the same source package with other contents are
///   removed, then the least recently used others while the folder holds more than `maxBytes`.
public struct CompiledModelCache: Sendable {
    public static let completeMarker = ".complete"
    /// Default size cap: room for the full-size fp16, q8 and q4 bundles' compiled models side by side.
    public static let defaultMaxBytes = 16 << 30

    public let folder: URL
    /// Size cap applied after each install (nil: none).
    public let maxBytes: Int?

    public init(folder: URL, maxBytes: Int? = CompiledModelCache.defaultMaxBytes) {
        self.folder = folder
        self.maxBytes = maxBytes
    }

    static func isComplete(_ entry: URL) -> Bool {
        FileManager.default.fileExists(atPath: entry.appendingPathComponent(completeMarker).path)
    }

    /// A temporary's name parts (entry name, kind "tmp" / "trash", pid), or nil for another name.
    static func temporary(_ name: String) -> (entry: String, kind: String, pid: Int32)? {
        guard name.hasPrefix(".") else { return nil }
        for kind in ["tmp", "trash"] {
            guard let range = name.range(of: ".mlmodelc.\(kind)-", options: .backwards) else { continue }
            let entry = String(name[name.index(after: name.startIndex)..<range.lowerBound]) + ".mlmodelc"
            let rest = name[range.upperBound...].split(separator: "-", omittingEmptySubsequences: false)
            guard rest.count == 2, let pid = Int32(rest[0]), !rest[1].isEmpty,
                  rest[1].allSatisfy({ $0.isHexDigit && !$0.isUppercase }), entry.count > ".mlmodelc".count else { return nil }
            return (entry, kind, pid)
        }
        return nil
    }

    static func packageName(of entryName: String) -> String {
        let stem = entryName.hasSuffix(".mlmodelc") ? String(entryName.dropLast(".mlmodelc".count)) : entryName
        if let dash = stem.lastIndex(of: "-"), stem.distance(from: dash, to: stem.endIndex) - 1 == 24 {
            return String(stem[..<dash])
        }
        return stem
    }

    static func alive(_ pid: Int32) -> Bool {
        if pid == ProcessInfo.processInfo.processIdentifier { return true }
        return kill(pid, 0) == 0 || errno != ESRCH
    }

    static func uniqueSuffix() -> String {
        "\(ProcessInfo.processInfo.processIdentifier)-" + UUID().uuidString.replacingOccurrences(of: "-", with: "").lowercased()
    }

    /// The marker's contents of a complete entry (`[:]` when empty or unreadable as JSON), nil when incomplete.
    static func marker(_ entry: URL) -> [String: Any]? {
        guard let data = FileManager.default.contents(atPath: entry.appendingPathComponent(completeMarker).path) else {
            return nil
        }
        return (try? JSONSerialization.jsonObject(with: data)) as? [String: Any] ?? [:]
    }

    static func folderSize(_ url: URL) -> Int {
        guard let files = FileManager.default.enumerator(at: url, includingPropertiesForKeys: [.fileSizeKey]) else { return 0 }
        var total = 0
        for case let file as URL in files {
            total += (try? file.resourceValues(forKeys: [.fileSizeKey]).fileSize) ?? 0
        }
        return total
    }

    /// The folder's entries, least recently used first (an absent folder: none).
    public func entries() -> [CompiledCacheEntry] {
        let fm = FileManager.default
        guard let names = try? fm.contentsOfDirectory(atPath: folder.path) else { return [] }
        var found: [CompiledCacheEntry] = []
        for name in names {
            let url = folder.appendingPathComponent(name)
            var isDirectory: ObjCBool = false
            guard fm.fileExists(atPath: url.path, isDirectory: &isDirectory), isDirectory.boolValue else { continue }
            let temporary = Self.temporary(name)
            guard temporary != nil || name.hasSuffix(".mlmodelc") else { continue }
            let marker = temporary == nil ? Self.marker(url) : nil
            let dated = marker != nil ? url.appendingPathComponent(Self.completeMarker) : url
            guard let used = (try? fm.attributesOfItem(atPath: dated.path))?[.modificationDate] as? Date else { continue }
            found.append(CompiledCacheEntry(url: url, package: Self.packageName(of: temporary?.entry ?? name),
                                            complete: marker != nil, size: Self.folderSize(url), lastUsed: used,
                                            source: marker?["source"] as? String, pid: temporary?.pid))
        }
        return found.sorted { ($0.lastUsed, $0.url.lastPathComponent) < ($1.lastUsed, $1.url.lastPathComponent) }
    }

    /// Removes one entry: renamed aside, then deleted. False when it was gone.
    @discardableResult
    public static func removeEntry(_ url: URL) -> Bool {
        let name = url.lastPathComponent
        let entryName = temporary(name)?.entry ?? name
        let trash = url.deletingLastPathComponent().appendingPathComponent(".\(entryName).trash-\(uniqueSuffix())")
        guard (try? FileManager.default.moveItem(at: url, to: trash)) != nil else { return false }
        try? FileManager.default.removeItem(at: trash)
        return true
    }

    /// Records a use of a complete entry; a read-only cache is left as it is.
    public static func touch(_ entry: URL) {
        try? FileManager.default.setAttributes([.modificationDate: Date()],
                                               ofItemAtPath: entry.appendingPathComponent(completeMarker).path)
    }

    static func removable(_ entry: CompiledCacheEntry) -> Bool {
        guard let pid = entry.pid else { return true }
        return !alive(pid)
    }

    /// Removes entries and returns them: per package name all but the `keep` most recently used complete ones;
    /// complete ones unused for `olderThan` seconds; the least recently used complete ones while the folder holds
    /// more than `maxBytes`; always temporaries whose process is gone and entries without a marker. `protect`:
    /// never removed (the entry just installed).
    @discardableResult
    public func prune(keep: Int? = nil, olderThan: TimeInterval? = nil, maxBytes: Int? = nil, protect: [URL] = [],
                      now: Date = Date()) -> [CompiledCacheEntry] {
        let protected = Set(protect.map(\.lastPathComponent))
        let current = entries()
        var doomed: [String: CompiledCacheEntry] = [:]
        for entry in current where !protected.contains(entry.url.lastPathComponent) {
            if !entry.complete {
                if Self.removable(entry) { doomed[entry.url.lastPathComponent] = entry }
            } else if let olderThan, now.timeIntervalSince(entry.lastUsed) > olderThan {
                doomed[entry.url.lastPathComponent] = entry
            }
        }
        if let keep {
            let groups = Dictionary(grouping: current.filter(\.complete), by: \.package)
            for group in groups.values {
                for entry in group.prefix(max(0, group.count - keep)) where !protected.contains(entry.url.lastPathComponent) {
                    doomed[entry.url.lastPathComponent] = entry
                }
            }
        }
        if let maxBytes {
            var total = current.filter { doomed[$0.url.lastPathComponent] == nil }.reduce(0) { $0 + $1.size }
            for entry in current where total > maxBytes {
                let name = entry.url.lastPathComponent
                if entry.complete, doomed[name] == nil, !protected.contains(name) {
                    doomed[name] = entry
                    total -= entry.size
                }
            }
        }
        return current.filter { doomed[$0.url.lastPathComponent] != nil && Self.removeEntry($0.url) }
    }

    /// Removes every entry (not the temporaries of a live process); returns them.
    @discardableResult
    public func clear() -> [CompiledCacheEntry] {
        entries().filter { Self.removable($0) && Self.removeEntry($0.url) }
    }

    /// Moves a freshly compiled model to `target` (staged, marked complete, renamed). True when installed, false
    /// when a complete `target` was already there (kept; the fresh copy dropped). A `target` without the marker
    /// is moved aside and removed, then the rename is tried again.
    @discardableResult
    public static func install(_ compiled: URL, at target: URL, source: URL?) throws -> Bool {
        let fm = FileManager.default
        let folder = target.deletingLastPathComponent()
        try fm.createDirectory(at: folder, withIntermediateDirectories: true)
        let staging = folder.appendingPathComponent(".\(target.lastPathComponent).tmp-\(uniqueSuffix())")
        try fm.moveItem(at: compiled, to: staging)
        var marker: [String: Any] = [:]
        if let source { marker["source"] = source.standardizedFileURL.path }
        try JSONSerialization.data(withJSONObject: marker).write(to: staging.appendingPathComponent(completeMarker))
        var lastError: Error?
        for _ in 0..<3 {
            do {
                try fm.moveItem(at: staging, to: target)  // fails while `target` exists
                return true
            } catch {
                lastError = error
                guard fm.fileExists(atPath: target.path) else { continue }  // removed meanwhile: try again
                if isComplete(target) {  // another process installed the same content: use it
                    try? fm.removeItem(at: staging)
                    return false
                }
                removeEntry(target)  // an incomplete leftover (never one of these installs)
            }
        }
        try? fm.removeItem(at: staging)
        throw lastError ?? CocoaError(.fileWriteUnknown)
    }

    /// Upkeep after installing `target` from `source`: the same package's other contents, then the size cap.
    @discardableResult
    public func afterInstall(target: URL, source: URL) -> [CompiledCacheEntry] {
        let path = source.standardizedFileURL.path
        var removed = entries().filter {
            $0.complete && $0.source == path && $0.url.lastPathComponent != target.lastPathComponent && Self.removeEntry($0.url)
        }
        if let maxBytes { removed += prune(maxBytes: maxBytes, protect: [target]) }
        return removed
    }
}
#endif
