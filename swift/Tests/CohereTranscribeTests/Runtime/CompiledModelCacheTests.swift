@testable import CohereTranscribe
import Foundation
import XCTest

/// The compiled-model cache's folder rules (`CompiledModelCache`, Python's runtime/compiled_cache.py): an install
/// never deletes a complete model, concurrent installs leave one complete entry, upkeep and list / clear / prune.
final class CompiledModelCacheTests: XCTestCase {
    let fm = FileManager.default

    func folder(_ tag: String) throws -> URL {
        let url = Fixtures.scratch.appendingPathComponent("cohere-cache-\(tag)-\(UUID().uuidString)", isDirectory: true)
        try fm.createDirectory(at: url, withIntermediateDirectories: true)
        addTeardownBlock { try? FileManager.default.removeItem(at: url) }
        return url
    }

    /// A "compiled model" folder holding one file of `bytes` bytes saying `text`.
    func compiled(in folder: URL, _ text: String, bytes: Int = 0) throws -> URL {
        let url = folder.appendingPathComponent("tmp-\(UUID().uuidString)").appendingPathComponent("model.mlmodelc")
        try fm.createDirectory(at: url, withIntermediateDirectories: true)
        var data = Data(text.utf8)
        if bytes > data.count { data.append(Data(count: bytes - data.count)) }
        try data.write(to: url.appendingPathComponent("weights"))
        return url
    }

    func text(_ entry: URL) throws -> String {
        String(decoding: try Data(contentsOf: entry.appendingPathComponent("weights")).prefix { $0 != 0 }, as: UTF8.self)
    }

    /// `<package>-<n as 24 hex digits>.mlmodelc`: the cache's naming shape.
    func entryName(_ package: String, _ n: Int) -> String {
        let hex = String(n, radix: 16)
        return "\(package)-\(String(repeating: "0", count: 24 - hex.count))\(hex).mlmodelc"
    }

    /// A complete target is kept: the second install of the same content drops its copy (the rule before this
    /// one deleted the target first, under a process that may be loading it).
    func testInstallKeepsACompleteTarget() throws {
        let cache = try folder("keep")
        let target = cache.appendingPathComponent(entryName("encoder", 1))
        XCTAssertTrue(try CompiledModelCache.install(try compiled(in: cache, "first"), at: target, source: nil))
        let second = try compiled(in: cache, "second")
        XCTAssertFalse(try CompiledModelCache.install(second, at: target, source: nil))
        XCTAssertEqual(try text(target), "first")
        XCTAssertTrue(CompiledModelCache.isComplete(target))
        XCTAssertFalse(fm.fileExists(atPath: second.path))
        XCTAssertEqual(CompiledModelCache(folder: cache).entries().map(\.url.lastPathComponent), [target.lastPathComponent])
    }

    /// A target without the marker (a leftover of something outside the rule) is replaced.
    func testInstallReplacesAnIncompleteLeftover() throws {
        let cache = try folder("leftover")
        let target = cache.appendingPathComponent(entryName("decoder", 2))
        try fm.createDirectory(at: target, withIntermediateDirectories: true)
        try Data("half".utf8).write(to: target.appendingPathComponent("junk"))
        XCTAssertTrue(try CompiledModelCache.install(try compiled(in: cache, "fresh"), at: target,
                                                     source: URL(fileURLWithPath: "/b/decoder.mlpackage")))
        XCTAssertEqual(try text(target), "fresh")
        XCTAssertFalse(fm.fileExists(atPath: target.appendingPathComponent("junk").path))
        XCTAssertEqual(CompiledModelCache(folder: cache).entries().first?.source, "/b/decoder.mlpackage")
    }

    /// Installs of the same content racing from several threads, 50 times: none fails, one complete entry is
    /// left, and no thread ever sees the target without its marker once one install has finished.
    func testConcurrentInstallsLeaveOneCompleteEntry() throws {
        let cache = try folder("race")
        for round in 0..<50 {
            let target = cache.appendingPathComponent(entryName("frontend", round))
            let fresh = try (0..<4).map { try compiled(in: cache, "copy \($0)") }
            let failures = Box(0), vanished = Box(0)
            DispatchQueue.concurrentPerform(iterations: fresh.count) { i in
                do {
                    _ = try CompiledModelCache.install(fresh[i], at: target, source: nil)
                    if !CompiledModelCache.isComplete(target) { vanished.mutate { $0 += 1 } }
                } catch {
                    failures.mutate { $0 += 1 }
                }
            }
            XCTAssertEqual(failures.value, 0, "round \(round)")
            XCTAssertEqual(vanished.value, 0, "round \(round)")
            XCTAssertTrue(try text(target).hasPrefix("copy "))
        }
        let left = try fm.contentsOfDirectory(atPath: cache.path).filter { $0.hasSuffix(".mlmodelc") || $0.hasPrefix(".") }
        XCTAssertEqual(left.count, 50)  // one entry per round, no staging or trash folder
        XCTAssertTrue(CompiledModelCache(folder: cache).entries().allSatisfy(\.complete))
    }

    /// After an install: the same source's other contents go, then the least recently used while over the cap.
    func testUpkeepAfterInstall() throws {
        let cache = try folder("upkeep")
        let source = URL(fileURLWithPath: "/bundles/f16/encoder.mlpackage")
        let other = URL(fileURLWithPath: "/bundles/q8/encoder.mlpackage")
        let old = cache.appendingPathComponent(entryName("encoder", 1))
        let q8 = cache.appendingPathComponent(entryName("encoder", 2))
        try CompiledModelCache.install(try compiled(in: cache, "old f16", bytes: 1000), at: old, source: source)
        try CompiledModelCache.install(try compiled(in: cache, "q8", bytes: 1000), at: q8, source: other)
        let new = cache.appendingPathComponent(entryName("encoder", 3))
        try CompiledModelCache.install(try compiled(in: cache, "new f16", bytes: 1000), at: new, source: source)
        let removed = CompiledModelCache(folder: cache, maxBytes: nil).afterInstall(target: new, source: source)
        XCTAssertEqual(removed.map(\.url.lastPathComponent), [old.lastPathComponent])
        XCTAssertEqual(Set(CompiledModelCache(folder: cache).entries().map(\.url.lastPathComponent)),
                       [q8.lastPathComponent, new.lastPathComponent])
        // a cap below both: the least recently used other entry goes, never the one just installed
        let capped = CompiledModelCache(folder: cache, maxBytes: 1500).afterInstall(target: new, source: source)
        XCTAssertEqual(capped.map(\.url.lastPathComponent), [q8.lastPathComponent])
        XCTAssertEqual(CompiledModelCache(folder: cache).entries().map(\.url.lastPathComponent), [new.lastPathComponent])
    }

    /// list / prune / clear on a populated folder: ages, sizes, per-package counts, interrupted installs.
    func testListPruneAndClear() throws {
        let cache = try folder("prune")
        let store = CompiledModelCache(folder: cache)
        let now = Date()
        var names: [String] = []
        for (i, (package, daysAgo)) in [("encoder", 40.0), ("encoder", 10.0), ("encoder", 1.0), ("decoder", 20.0)].enumerated() {
            let target = cache.appendingPathComponent(entryName(package, i))
            try CompiledModelCache.install(try compiled(in: cache, "\(package) \(i)", bytes: 100), at: target, source: nil)
            try fm.setAttributes([.modificationDate: now.addingTimeInterval(-daysAgo * 86400)],
                                 ofItemAtPath: target.appendingPathComponent(CompiledModelCache.completeMarker).path)
            names.append(target.lastPathComponent)
        }
        // an interrupted install of a process that is gone, and one of this (live) process
        let dead = cache.appendingPathComponent(".\(entryName("encoder", 9)).tmp-999999-0123abcd")
        let live = cache.appendingPathComponent(".\(entryName("encoder", 8)).tmp-\(ProcessInfo.processInfo.processIdentifier)-89ef")
        try fm.createDirectory(at: dead, withIntermediateDirectories: true)
        try fm.createDirectory(at: live, withIntermediateDirectories: true)
        let listed = store.entries()
        XCTAssertEqual(listed.filter(\.complete).map(\.url.lastPathComponent), [names[0], names[3], names[1], names[2]])
        XCTAssertEqual(listed.filter(\.complete).map(\.package), ["encoder", "decoder", "encoder", "encoder"])
        XCTAssertTrue(listed.filter(\.complete).allSatisfy { $0.size >= 100 })
        XCTAssertEqual(Set(listed.compactMap(\.pid)), [999_999, ProcessInfo.processInfo.processIdentifier])
        // keep 2 per package: the oldest encoder goes, and the dead process's leftover
        let kept = store.prune(keep: 2, now: now)
        XCTAssertEqual(Set(kept.map(\.url.lastPathComponent)), [names[0], dead.lastPathComponent])
        // unused for 15 days: the decoder
        XCTAssertEqual(store.prune(olderThan: 15 * 86400, now: now).map(\.url.lastPathComponent), [names[3]])
        // clear: the rest, but not the live process's install
        XCTAssertEqual(Set(store.clear().map(\.url.lastPathComponent)), [names[1], names[2]])
        XCTAssertEqual(store.entries().map(\.url.lastPathComponent), [live.lastPathComponent])
    }

    /// The temporaries' names as Python writes and parses them (compiled_cache.TEMPORARY_NAME).
    func testTemporaryNamesArePythons() {
        let parsed = CompiledModelCache.temporary(".encoder-0123456789abcdef01234567.mlmodelc.tmp-4242-9f0e")
        XCTAssertEqual(parsed?.entry, "encoder-0123456789abcdef01234567.mlmodelc")
        XCTAssertEqual(parsed?.kind, "tmp")
        XCTAssertEqual(parsed?.pid, 4242)
        XCTAssertEqual(CompiledModelCache.temporary(".decoder-x.mlmodelc.trash-7-ab")?.kind, "trash")
        XCTAssertNil(CompiledModelCache.temporary(".encoder.mlmodelc.tmp-12-XYZ"))
        XCTAssertNil(CompiledModelCache.temporary("encoder-1.mlmodelc"))
        XCTAssertEqual(CompiledModelCache.packageName(of: "encoder_part2-0123456789abcdef01234567.mlmodelc"), "encoder_part2")
    }
}
