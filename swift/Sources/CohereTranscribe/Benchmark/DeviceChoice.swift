import Foundation
#if canImport(os)
import os
#endif

// The device decides: `cohere-transcribe-swift bench` runs every candidate — a compute-units
// choice x a package layout the bundle holds — in a child process each (DeviceSweep.swift) and writes
// `device-choice.json`; `CohereTranscriber` reads it to choose its compute units and checks its layout.
// Schema and rule: docs/swift.md, "The device decides".

// MARK: - layouts

/// One way the bundle's programs are laid out, as the manifest says (`decoder.state_writes`, the encoder whole or in
/// parts). A layout is the value of every `BundleLayout.axes` entry; a bundle holds the product of the values each
/// axis reads (today one value per axis: one layout). Adding a layout dimension is one `Axis` entry.
public struct BundleLayout: Sendable, Equatable, Hashable, CustomStringConvertible {
    /// Axis key -> value, e.g. ["decoder.state_writes": "graph", "encoder.parts": "whole"].
    public var values: [String: String]

    public init(values: [String: String]) { self.values = values }

    /// "decoder.state_writes=graph,encoder.parts=whole" (axes in `BundleLayout.axes` order).
    public var id: String {
        BundleLayout.axes.compactMap { axis in values[axis.key].map { "\(axis.key)=\($0)" } }.joined(separator: ",")
    }

    public var description: String { id }

    /// A layout dimension: its key and the values a manifest (raw JSON object) offers for it.
    public struct Axis: Sendable {
        public var key: String
        public var values: @Sendable ([String: Any]) -> [String]
    }

    /// Every layout dimension the bench varies. `decoder.state_writes`: "graph" (the step writes its KV state in the
    /// graph; what a manifest without the field means) or "host" (the host writes the new rows,
    /// `MLState.withMultiArray(for:)`). `encoder.parts`: "whole" (one encoder program) or "N" (`encoder.parts`, a
    /// list of N part entries or the count, chained through the hidden state).
    public static let axes: [Axis] = [
        Axis(key: "decoder.state_writes") { raw in
            [((raw["decoder"] as? [String: Any])?["state_writes"] as? String) ?? "graph"]
        },
        Axis(key: "encoder.parts") { raw in
            let parts = (raw["encoder"] as? [String: Any])?["parts"]
            let n = (parts as? [Any])?.count ?? (parts as? Int) ?? 1
            return [n <= 1 ? "whole" : String(n)]
        },
    ]

    /// The layouts a manifest (raw JSON object) holds: the product of every axis's values, in axis order.
    public static func layouts(manifest raw: [String: Any]) -> [BundleLayout] {
        var out: [[String: String]] = [[:]]
        for axis in axes {
            out = out.flatMap { partial in axis.values(raw).map { partial.merging([axis.key: $0]) { $1 } } }
        }
        return out.map(BundleLayout.init(values:))
    }

    /// The layouts of the bundle folder's manifest.json.
    public static func layouts(bundle: URL) throws -> [BundleLayout] {
        let url = bundle.appendingPathComponent(BundleManifest.fileName)
        guard let data = try? Data(contentsOf: url),
              let raw = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else {
            throw BundleError.unreadableManifest("cannot read \(url.path) as a JSON object")
        }
        return layouts(manifest: raw)
    }
}

// MARK: - candidates

/// One thing the bench tries: the same compute units for every component (front end, encoder, decoder) and a layout.
public struct DeviceCandidate: Sendable, Equatable, CustomStringConvertible {
    public var computeUnits: ComputeUnits
    public var layout: BundleLayout

    public init(computeUnits: ComputeUnits, layout: BundleLayout) {
        self.computeUnits = computeUnits
        self.layout = layout
    }

    /// "cpu_only@decoder.state_writes=graph,encoder.parts=whole".
    public var id: String { "\(computeUnits.rawValue)@\(layout.id)" }
    public var description: String { id }
    public var components: ComponentComputeUnits { .uniform(computeUnits) }

    /// The order candidates run in: CPU first (the reference), then GPU, Neural Engine, all.
    public static let unitsOrder: [ComputeUnits] = [.cpuOnly, .cpuAndGPU, .cpuAndNeuralEngine, .all]

    /// Every candidate of the bundle: `units` (default: all four, in `unitsOrder`) x its layouts.
    public static func all(bundle: URL, units: [ComputeUnits]? = nil) throws -> [DeviceCandidate] {
        let layouts = try BundleLayout.layouts(bundle: bundle)
        let chosenUnits = units.map { u in unitsOrder.filter(u.contains) } ?? unitsOrder
        return layouts.flatMap { layout in chosenUnits.map { DeviceCandidate(computeUnits: $0, layout: layout) } }
    }
}

// MARK: - the file

/// `device-choice.json`: what the bench chose on this device, and every candidate's figures (written by
/// `DeviceSweep`; read by `CohereTranscriber`). Read and written as plain JSON objects (`JSONSerialization`),
/// checked field by field when read.
public enum DeviceChoice {
    public static let fileName = "device-choice.json"
    public static let kind = "device-choice"
    public static let formatVersion = 1
    /// The rule `select` applies (also written into the file).
    public static let rule = "the fastest candidate (smallest totals.processing_s: warm transcription time over the benched "
        + "clips) among those whose child process completed with every clip's status and token ids equal to the reference's; "
        + "reference: the first cpu_only candidate that completed, else the token ids most completed candidates agree on "
        + "(ties: the earlier candidate); load times and placement are recorded, not used"

    /// The default place of the device-choice of a bundle (writable in an app: not inside the bundle, which may be
    /// read-only in an app's resources and whose files `cohere-coreml bundle verify` lists): Application Support/
    /// CohereTranscribe/device-choice/<first 16 hex of the bundle's manifest sha256>.json.
    public static func defaultLocation(bundle: URL) throws -> URL {
        let sha = try SHA256.hexDigest(ofFile: bundle.appendingPathComponent(BundleManifest.fileName))
        let support = FileManager.default.urls(for: .applicationSupportDirectory, in: .userDomainMask).first
            ?? URL(fileURLWithPath: NSTemporaryDirectory())
        return support.appendingPathComponent("CohereTranscribe").appendingPathComponent("device-choice")
            .appendingPathComponent("\(sha.prefix(16)).json")
    }

    /// A candidate's outcome, as `select` sees it: whether its child completed, its warm time and per clip
    /// (manifest index) its status and token ids.
    public struct Outcome: Sendable {
        public var id: String
        public var computeUnits: ComputeUnits
        public var completed: Bool
        public var processingSeconds: Double?
        public var clips: [Int: ClipTokens]

        public init(id: String, computeUnits: ComputeUnits, completed: Bool, processingSeconds: Double?,
                    clips: [Int: ClipTokens]) {
            self.id = id
            self.computeUnits = computeUnits
            self.completed = completed
            self.processingSeconds = processingSeconds
            self.clips = clips
        }
    }

    public struct ClipTokens: Sendable, Equatable {
        public var status: String
        public var tokenIds: [[Int]]?
        public init(status: String, tokenIds: [[Int]]?) { self.status = status; self.tokenIds = tokenIds }
    }

    public struct Selection: Sendable, Equatable {
        public var reference: String?
        public var chosen: String?
        /// Per candidate id: its tokens equal the reference's (nil: it did not complete).
        public var matchesReference: [String: Bool]
        /// Per candidate id: the clip indices whose status or tokens differ from the reference's.
        public var mismatchedClips: [String: [Int]]
    }

    /// `rule`, applied.
    public static func select(_ outcomes: [Outcome]) -> Selection {
        let done = outcomes.filter(\.completed)
        var reference = done.first { $0.computeUnits == .cpuOnly }
        if reference == nil {
            var best: (Outcome, Int)?
            for o in done {
                let agree = done.filter { $0.clips == o.clips }.count
                if best == nil || agree > best!.1 { best = (o, agree) }
            }
            reference = best?.0
        }
        var matches: [String: Bool] = [:], mismatched: [String: [Int]] = [:]
        for o in done {
            let want = reference?.clips ?? [:]
            let bad = Set(want.keys).union(o.clips.keys).filter { want[$0] != o.clips[$0] }.sorted()
            matches[o.id] = bad.isEmpty
            mismatched[o.id] = bad
        }
        let eligible = done.filter { matches[$0.id] == true && $0.processingSeconds != nil }
        var chosen: Outcome?
        for o in eligible where chosen == nil || o.processingSeconds! < chosen!.processingSeconds! { chosen = o }
        return Selection(reference: reference?.id, chosen: chosen?.id, matchesReference: matches, mismatchedClips: mismatched)
    }

    // MARK: reading (CohereTranscriber)

    /// Where `CohereTranscriber` takes its device choice from.
    public enum Source: Sendable, Equatable {
        /// `defaultLocation(bundle:)` if it exists (measured on this device), else `<bundle>/device-choice.json`
        /// (shipped with the bundle), else none (today's defaults, no warning).
        case automatic
        /// This file (a missing or malformed one: today's defaults and a warning).
        case file(URL)
        /// Never read one.
        case none
    }

    /// What a transcriber did with the device choice.
    public struct Applied: Sendable, Equatable {
        /// The file read (nil: none found or `.none`).
        public var file: URL?
        /// True when its chosen compute units are the ones used.
        public var applied: Bool
        /// The chosen candidate's id, when applied.
        public var candidate: String?
        /// The layout the transcriber runs (the bundle's).
        public var layout: BundleLayout?
        /// Why a file was not applied (also logged).
        public var warning: String?

        public static let notRead = Applied(file: nil, applied: false, candidate: nil, layout: nil, warning: nil)
    }

    /// The chosen candidate of a device-choice file, as read.
    public struct Chosen: Sendable {
        public var candidate: String
        public var computeUnits: ComponentComputeUnits
        public var layoutID: String
        public var bundleManifestSHA256: String
        public var device: String?
    }

    /// A device-choice file that cannot be used (malformed, or no choice in it).
    public struct Malformed: Error, CustomStringConvertible {
        public var description: String
    }

    /// Reads and checks a device-choice file. Throws `Malformed` naming the field.
    public static func read(_ url: URL) throws -> Chosen? {
        let data: Data
        do { data = try Data(contentsOf: url) } catch {
            throw Malformed(description: "\(url.path): cannot read it (\(error.localizedDescription))")
        }
        guard let top = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else {
            throw Malformed(description: "\(url.path): not a JSON object")
        }
        func bad(_ field: String, _ problem: String) -> Malformed { Malformed(description: "\(url.path): \(field): \(problem)") }
        guard top["kind"] as? String == kind else { throw bad("kind", "expected \"\(kind)\", got \(top["kind"] ?? "nothing")") }
        guard let version = top["format_version"] as? Int else { throw bad("format_version", "missing or not an integer") }
        guard version == formatVersion else { throw bad("format_version", "\(version) is not \(formatVersion)") }
        guard let sha = (top["bundle"] as? [String: Any])?["manifest_sha256"] as? String, sha.count == 64 else {
            throw bad("bundle.manifest_sha256", "missing or not a sha256")
        }
        guard top.keys.contains("chosen") else { throw bad("chosen", "missing") }
        if top["chosen"] is NSNull { return nil }
        guard let chosen = top["chosen"] as? [String: Any] else { throw bad("chosen", "not an object or null") }
        guard let candidate = chosen["candidate"] as? String else { throw bad("chosen.candidate", "missing or not a string") }
        guard let units = chosen["compute_units"] as? [String: Any] else { throw bad("chosen.compute_units", "missing") }
        func unit(_ key: String) throws -> ComputeUnits {
            guard let s = units[key] as? String, let u = ComputeUnits(rawValue: s) else {
                throw bad("chosen.compute_units.\(key)", "\(units[key].map { "'\($0)'" } ?? "missing") is not one of "
                    + ComputeUnits.allCases.map(\.rawValue).joined(separator: ", "))
            }
            return u
        }
        let components = ComponentComputeUnits(frontEnd: try unit("front_end"), encoder: try unit("encoder"),
                                               decoder: try unit("decoder"))
        guard let layout = (chosen["layout"] as? [String: Any])?["id"] as? String else {
            throw bad("chosen.layout.id", "missing or not a string")
        }
        let device = (top["machine"] as? [String: Any])?["device"] as? String
        return Chosen(candidate: candidate, computeUnits: components, layoutID: layout, bundleManifestSHA256: sha, device: device)
    }

    /// What `CohereTranscriber.init` uses: the compute units to run (nil: today's defaults) and the record of it.
    /// Throws only when the file chooses a layout the bundle does not hold; every other problem is a warning.
    static func resolve(_ source: Source, bundle: URL) throws -> (ComponentComputeUnits?, Applied) {
        let layouts = (try? BundleLayout.layouts(bundle: bundle)) ?? []
        var record = Applied(file: nil, applied: false, candidate: nil, layout: layouts.first, warning: nil)
        let url: URL
        switch source {
        case .none:
            return (nil, record)
        case .file(let u):
            url = u
        case .automatic:
            let candidates = [try? defaultLocation(bundle: bundle), bundle.appendingPathComponent(fileName)].compactMap { $0 }
            guard let found = candidates.first(where: { FileManager.default.fileExists(atPath: $0.path) }) else {
                return (nil, record)
            }
            url = found
        }
        record.file = url
        func fallBack(_ why: String) -> (ComponentComputeUnits?, Applied) {
            record.warning = "device choice not used, today's default compute units instead: \(why)"
            warn(record.warning!)
            return (nil, record)
        }
        let chosen: Chosen?
        do {
            chosen = try read(url)
        } catch {
            return fallBack("\(error)")
        }
        guard let chosen else { return fallBack("\(url.path) chose no candidate (none completed with the reference's tokens)") }
        guard let layout = layouts.first(where: { $0.id == chosen.layoutID }) else {
            throw TranscriptionError.invalidArgument(
                "device choice \(url.path) chose layout '\(chosen.layoutID)' (candidate \(chosen.candidate)), which the bundle "
                    + "\(bundle.path) does not hold (it holds: \(layouts.map(\.id).joined(separator: "; "))): run "
                    + "`cohere-transcribe-swift bench` on this bundle again, or pass deviceChoice: .none")
        }
        let sha = (try? SHA256.hexDigest(ofFile: bundle.appendingPathComponent(BundleManifest.fileName))) ?? ""
        guard sha == chosen.bundleManifestSHA256 else {
            return fallBack("\(url.path) was measured on another bundle (manifest sha256 \(chosen.bundleManifestSHA256.prefix(12)), "
                + "this one \(sha.prefix(12)))")
        }
        let device = DeviceBenchmark.MachineRecord.current().device
        if let measured = chosen.device, measured != device {
            return fallBack("\(url.path) was measured on \(measured), this device is \(device)")
        }
        record.applied = true
        record.candidate = chosen.candidate
        record.layout = layout
        return (chosen.computeUnits, record)
    }

    static func warn(_ message: String) {
        #if canImport(os)
        Logger(subsystem: "CohereTranscribe", category: "device-choice").warning("\(message, privacy: .public)")
        #else
        FileHandle.standardError.write(Data("CohereTranscribe: warning: \(message)\n".utf8))
        #endif
    }
}
