import Foundation

/// A dataset folder read exactly as `cohere_coreml.evaluation.datasets.load_folder` reads it (manifest.jsonl, else
/// manifest.json: a list or {"utterances" | "clips" | "items": [...]}; "file" | "audio" | "path", "text",
/// "language", optional "id"), with the manifest's sha256 over its bytes (as Python's).
public struct BenchDataset: Sendable {
    public struct Entry: Sendable {
        /// Position in the manifest (ids need not be unique).
        public var index: Int
        public var id: String
        public var file: String?
        public var url: URL
        public var text: String
        public var language: String
        /// Why the clip cannot be scored (no file named, file missing, empty reference), as Python says it.
        public var problem: String?
    }

    public var name: String
    public var manifestPath: String
    public var manifestSHA256: String
    public var entries: [Entry]

    public static func load(_ folder: String) throws -> BenchDataset {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: folder, isDirectory: &isDirectory), isDirectory.boolValue else {
            throw BenchmarkError("dataset folder not found: \(folder)")
        }
        let directory = URL(fileURLWithPath: folder)
        guard let name = ["manifest.jsonl", "manifest.json"].first(where: {
            FileManager.default.fileExists(atPath: directory.appendingPathComponent($0).path)
        }) else {
            throw BenchmarkError("no manifest.jsonl or manifest.json in \(folder)")
        }
        let path = (folder as NSString).appendingPathComponent(name)
        let manifestURL = directory.appendingPathComponent(name)
        let data = try Data(contentsOf: manifestURL)
        var list: [Any]
        do {
            if name.hasSuffix(".jsonl") {
                list = try String(decoding: data, as: UTF8.self).split(whereSeparator: \.isNewline)
                    .filter { !$0.trimmingCharacters(in: .whitespaces).isEmpty }
                    .map { try JSONSerialization.jsonObject(with: Data($0.utf8), options: [.fragmentsAllowed]) }
            } else {
                let top = try JSONSerialization.jsonObject(with: data, options: [.fragmentsAllowed])
                if let dict = top as? [String: Any] {
                    guard let l = ["utterances", "clips", "items"].lazy.compactMap({ dict[$0] as? [Any] })
                        .first(where: { !$0.isEmpty }) else {
                        throw BenchmarkError("\(path): expected a list of entries (or an 'utterances' list)")
                    }
                    list = l
                } else if let l = top as? [Any] {
                    list = l
                } else {
                    throw BenchmarkError("\(path): expected a list of entries (or an 'utterances' list)")
                }
            }
        } catch let error as BenchmarkError {
            throw error
        } catch {
            throw BenchmarkError("\(path): not valid JSON (\(error.localizedDescription))")
        }
        func text(_ value: Any?) -> String? {
            switch value {
            case let s as String: return s.isEmpty ? nil : s
            case let n as NSNumber: return n == 0 ? nil : n.stringValue
            default: return nil
            }
        }
        var entries: [Entry] = []
        for (i, item) in list.enumerated() {
            guard let entry = item as? [String: Any] else { throw BenchmarkError("\(path): entry \(i) is not an object") }
            guard let language = text(entry["language"]) else { throw BenchmarkError("\(path): entry \(i) has no language") }
            let file = text(entry["file"]) ?? text(entry["audio"]) ?? text(entry["path"])
            let reference = text(entry["text"]) ?? ""
            let url = file.map { $0.hasPrefix("/") ? URL(fileURLWithPath: $0) : directory.appendingPathComponent($0) }
                ?? directory
            var problem: String?
            if let file {
                if !FileManager.default.fileExists(atPath: url.path) {
                    problem = "audio file not found: \(displayPath(folder, file))"
                } else if reference.trimmingCharacters(in: .whitespacesAndNewlines).isEmpty {
                    problem = "empty reference transcript"
                }
            } else {
                problem = "no audio file named"
            }
            entries.append(Entry(index: i, id: text(entry["id"]) ?? file ?? String(i), file: file, url: url,
                                 text: reference, language: language, problem: problem))
        }
        guard !entries.isEmpty else { throw BenchmarkError("\(path) lists no clips") }
        return BenchDataset(name: folder, manifestPath: path, manifestSHA256: try SHA256.hexDigest(ofFile: manifestURL),
                            entries: entries)
    }

    private static func displayPath(_ folder: String, _ file: String) -> String {
        file.hasPrefix("/") ? file : (folder as NSString).appendingPathComponent(file)
    }

    public var languages: [String] { Array(Set(entries.map(\.language))).sorted() }

    func record(benched: Int) -> DeviceBenchmark.DatasetRecord {
        DeviceBenchmark.DatasetRecord(name: name, manifest: manifestPath, manifestSHA256: manifestSHA256, clips: entries.count,
                      benchedClips: benched, languages: languages)
    }
}
