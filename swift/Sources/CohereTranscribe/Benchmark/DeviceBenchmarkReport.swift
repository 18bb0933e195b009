import Foundation
#if canImport(Darwin)
import Darwin
#elseif canImport(Glibc)
import Glibc
#endif

extension DeviceBenchmark {

    /// The JSON `cohere-transcribe-swift bench` writes (schema: docs/swift.md, "Measuring on a device").
    public struct Report: Encodable, Sendable {
        public var tool = DeviceBenchmark.tool
        public var formatVersion = DeviceBenchmark.formatVersion
        public var createdUTC: String
        public var runtime: String
        public var computeUnits: UnitsRecord
        public var machine: MachineRecord
        public var dataset: DatasetRecord
        public var bundle: BundleRecord
        public var options: OptionsRecord
        public var load: LoadRecord
        public var firstRunSeconds: Double?
        public var memory: MemoryRecord
        public var placement: PlacementRecord
        public var placementReason: String?
        public var totals: Totals
        public var clips: [ClipRecord]
        /// The sweep's candidate this report measures (nil: a plain `bench` run).
        public var candidate: CandidateRecord?

        public var failedClips: Int { clips.filter { $0.status == "problem" }.count }

        enum CodingKeys: String, CodingKey {
            case tool, formatVersion = "format_version", createdUTC = "created_utc", runtime, computeUnits = "compute_units",
                 machine, dataset, bundle, options, load, firstRunSeconds = "first_run_s", memory, placement,
                 placementReason = "placement_reason", totals, clips, candidate
        }

        public func json() throws -> Data {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
            return try encoder.encode(self)
        }
    }

    public struct CandidateRecord: Encodable, Sendable {
        public var id: String
        public var computeUnits: String
        public var layout: [String: String]

        enum CodingKeys: String, CodingKey { case id, computeUnits = "compute_units", layout }
    }

    public struct UnitsRecord: Encodable, Sendable {
        public var flag: String?
        public var frontEnd: String
        public var encoder: String
        public var decoder: String
        public var note: String?

        enum CodingKeys: String, CodingKey { case flag, frontEnd = "front_end", encoder, decoder, note }
    }

    public struct DatasetRecord: Encodable, Sendable {
        public var name: String
        public var manifest: String
        public var manifestSHA256: String
        public var clips: Int
        public var benchedClips: Int
        public var languages: [String]

        enum CodingKeys: String, CodingKey {
            case name, manifest, manifestSHA256 = "manifest_sha256", clips, benchedClips = "benched_clips", languages
        }
    }

    public struct OptionsRecord: Encodable, Sendable {
        public var maxClips: Int?
        public var language: String?
        public var languageFromManifest: Bool
        public var maxNewTokens: Int?
        public var warmup: Bool
        public var beams = 1
        public var repetitionGuard = false
        /// The VAD mode asked (auto: on when the bundle has vad.mlpackage; docs/vad.md).
        public var vad = VADMode.auto.rawValue

        enum CodingKeys: String, CodingKey {
            case maxClips = "max_clips", language, languageFromManifest = "language_from_manifest",
                 maxNewTokens = "max_new_tokens", warmup, beams, repetitionGuard = "repetition_guard", vad
        }
    }

    /// The benched bundle, described as `cohere_coreml.evaluation.bench.bundle_info` describes it (+ what scoring needs).
    public struct BundleRecord: Encodable, Sendable {
        public var dir: String
        public var manifestSHA256: String
        public var modelId: String?
        public var precision: String?
        public var preset: String?
        public var gate: String
        /// Encoder + decoder packages (MB, 2^20 bytes), as Python's `size_mb`.
        public var sizeMB: Double
        public var eosTokenIds: [Int]
        public var prefill: Bool
        public var capacity: Int?

        enum CodingKeys: String, CodingKey {
            case dir, manifestSHA256 = "manifest_sha256", modelId = "model_id", precision, preset, gate, sizeMB = "size_mb",
                 eosTokenIds = "eos_token_ids", prefill, capacity
        }

        static func read(_ bundle: URL) throws -> BundleRecord {
            let manifestURL = bundle.appendingPathComponent(BundleManifest.fileName)
            guard FileManager.default.fileExists(atPath: manifestURL.path) else {
                throw BundleError.missingFile("no manifest.json in \(bundle.path)")
            }
            let raw = try JSONSerialization.jsonObject(with: Data(contentsOf: manifestURL)) as? [String: Any] ?? [:]
            let files = raw["files"] as? [String: Any] ?? [:]
            let decoder = raw["decoder"] as? [String: Any] ?? [:]
            let tokens = raw["tokens"] as? [String: Any] ?? [:]
            var gate = "export"
            let compression = bundle.appendingPathComponent("compression.json")
            if FileManager.default.fileExists(atPath: compression.path) {
                let c = (try? JSONSerialization.jsonObject(with: Data(contentsOf: compression))) as? [String: Any]
                let g = c?["gate"] as? [String: Any] ?? [:]
                gate = (g["skipped"] as? Bool ?? false) ? "skipped" : (g["passed"] as? Bool ?? false) ? "passed" : "unknown"
            }
            let packages = ["encoder", "decoder"].compactMap { files[$0] as? String }.map { bundle.appendingPathComponent($0) }
            let bytes = packages.reduce(0) { $0 + directoryBytes($1) }
            return BundleRecord(dir: bundle.path, manifestSHA256: try SHA256.hexDigest(ofFile: manifestURL),
                                modelId: raw["model_id"] as? String, precision: raw["precision"] as? String,
                                preset: raw["preset"] as? String ?? "f16", gate: gate,
                                sizeMB: (Double(bytes) / 1_048_576 * 1000).rounded() / 1000,
                                eosTokenIds: tokens["eos_token_ids"] as? [Int] ?? [],
                                prefill: (decoder["functions"] as? [String: Any])?["prefill"] is String,
                                capacity: decoder["capacity"] as? Int)
        }

        static func directoryBytes(_ url: URL) -> Int {
            guard let files = FileManager.default.enumerator(at: url, includingPropertiesForKeys: [.fileSizeKey, .isRegularFileKey])
            else { return 0 }
            var total = 0
            for case let file as URL in files {
                let values = try? file.resourceValues(forKeys: [.fileSizeKey, .isRegularFileKey])
                if values?.isRegularFile == true { total += values?.fileSize ?? 0 }
            }
            return total
        }
    }

    /// Cold and warm load, seconds. Each: `CohereTranscriber.init` (decoder, prefill, full-window encoder) +
    /// `prewarm()` (every other encoder bucket and front-end function).
    public struct LoadRecord: Encodable, Sendable {
        public var cold = 0.0
        public var coldInit = 0.0
        public var coldPrewarm = 0.0
        /// `CohereTranscriber.loadSeconds` of the first transcriber (package loads only).
        public var coldTranscriberLoad = 0.0
        public var warm = 0.0
        public var warmInit = 0.0
        public var warmPrewarm = 0.0
        public var warmTranscriberLoad = 0.0
        public var compiledCacheBefore: [String: Bool]?
        public var note = ""

        enum CodingKeys: String, CodingKey {
            case cold = "cold_s", coldInit = "cold_init_s", coldPrewarm = "cold_prewarm_s",
                 coldTranscriberLoad = "cold_transcriber_load_s", warm = "warm_s", warmInit = "warm_init_s",
                 warmPrewarm = "warm_prewarm_s", warmTranscriberLoad = "warm_transcriber_load_s",
                 compiledCacheBefore = "compiled_cache_before", note
        }
    }

    /// Memory of this process, MB (2^20 bytes). Darwin: `phys_footprint` (task_info TASK_VM_INFO), the figure
    /// iOS's memory limit applies to, sampled before/after the loads and after each clip (peak = the largest
    /// sample). Linux: VmHWM of /proc/self/status (the kernel's peak resident size); the interpreter child's
    /// memory is not in it (its own VmHWM is `interpreter_child_peak_mb`).
    public struct MemoryRecord: Encodable, Sendable {
        public var measure: String
        public var beforeLoadMB: Double?
        public var afterColdLoadMB: Double?
        public var afterLoadMB: Double?
        public var peakMB: Double?
        public var interpreterChildPeakMB: Double?
        public var includesInterpreterChild = false
        public var note: String

        enum CodingKeys: String, CodingKey {
            case measure, beforeLoadMB = "before_load_mb", afterColdLoadMB = "after_cold_load_mb",
                 afterLoadMB = "after_load_mb", peakMB = "peak_mb", interpreterChildPeakMB = "interpreter_child_peak_mb",
                 includesInterpreterChild = "includes_interpreter_child", note
        }

        init() {
            #if canImport(Darwin)
            measure = "phys_footprint"
            note = "task_info(TASK_VM_INFO).phys_footprint of this process, sampled after the loads and after each clip; "
                + "peak_mb is the largest sample"
            #else
            measure = "VmHWM"
            note = "VmHWM of /proc/self/status (peak resident set of this process); the interpreter child's memory "
                + "(cohere-coreml serve-runtime) is not in it: see interpreter_child_peak_mb"
            #endif
        }

        /// The measure now (Darwin: footprint; Linux: peak so far), folded into `peakMB`.
        mutating func sample() -> Double? {
            let value = MemoryRecord.currentMB()
            if let value { peakMB = max(peakMB ?? 0, value) }
            return value
        }

        mutating func finish(runtime: ModelRuntime) {
            _ = sample()
            #if os(Linux)
            if let interpreter = runtime as? InterpreterRuntime {
                interpreterChildPeakMB = MemoryRecord.procStatusMB(path: "/proc/\(interpreter.processIdentifier)/status", key: "VmHWM")
            }
            #endif
        }

        static func currentMB() -> Double? {
            #if canImport(Darwin)
            var info = task_vm_info_data_t()
            var count = mach_msg_type_number_t(MemoryLayout<task_vm_info_data_t>.size / MemoryLayout<integer_t>.size)
            let result = withUnsafeMutablePointer(to: &info) {
                $0.withMemoryRebound(to: integer_t.self, capacity: Int(count)) {
                    task_info(mach_task_self_, task_flavor_t(TASK_VM_INFO), $0, &count)
                }
            }
            guard result == KERN_SUCCESS else { return nil }
            return (Double(info.phys_footprint) / 1_048_576 * 10).rounded() / 10
            #else
            return procStatusMB(path: "/proc/self/status", key: "VmHWM")
            #endif
        }

        /// A "Key:   1234 kB" line of a /proc status file, in MB.
        static func procStatusMB(path: String, key: String) -> Double? {
            guard let text = try? String(contentsOfFile: path, encoding: .utf8) else { return nil }
            for line in text.split(separator: "\n") where line.hasPrefix(key + ":") {
                let fields = line.split(whereSeparator: { $0 == " " || $0 == "\t" })
                if fields.count >= 2, let kb = Double(fields[1]) { return (kb / 1024 * 10).rounded() / 10 }
            }
            return nil
        }
    }

    public struct MachineRecord: Encodable, Sendable {
        public var platform: String
        public var os: String
        public var osVersion: String
        /// Hardware model: macOS `hw.model` (e.g. Mac14,2), iOS the machine id (e.g. iPhone15,2), else `uname -m`.
        public var device: String
        public var chip: String?
        public var cpus: Int
        public var memoryGB: Double
        public var simulator = false

        enum CodingKeys: String, CodingKey {
            case platform, os, osVersion = "os_version", device, chip, cpus, memoryGB = "memory_gb", simulator
        }

        static func current() -> MachineRecord {
            var u = utsname()
            _ = uname(&u)
            let machine = withUnsafeBytes(of: &u.machine) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            #if os(macOS)
            let (platform, device, chip) = ("macOS", sysctl("hw.model") ?? machine, sysctl("machdep.cpu.brand_string"))
            #elseif os(iOS)
            let (platform, device, chip) = ("iOS", ProcessInfo.processInfo.environment["SIMULATOR_MODEL_IDENTIFIER"] ?? machine,
                                            sysctl("machdep.cpu.brand_string"))
            #elseif os(Linux)
            let (platform, device, chip): (String, String, String?) = ("Linux", machine, nil)
            #else
            let (platform, device, chip): (String, String, String?) = ("other", machine, nil)
            #endif
            var record = MachineRecord(platform: platform, os: platform,
                                       osVersion: ProcessInfo.processInfo.operatingSystemVersionString, device: device,
                                       chip: chip, cpus: ProcessInfo.processInfo.activeProcessorCount,
                                       memoryGB: (Double(ProcessInfo.processInfo.physicalMemory) / 1_073_741_824 * 10).rounded() / 10)
            #if targetEnvironment(simulator)
            record.simulator = true
            #endif
            return record
        }

        static func sysctl(_ name: String) -> String? {
            #if canImport(Darwin)
            var size = 0
            guard sysctlbyname(name, nil, &size, nil, 0) == 0, size > 0 else { return nil }
            var buffer = [CChar](repeating: 0, count: size)
            guard sysctlbyname(name, &buffer, &size, nil, 0) == 0 else { return nil }
            return String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
            #else
            return nil
            #endif
        }
    }

    /// `"unavailable"` (with `Report.placementReason`) or `{"functions": [...]}`.
    public enum PlacementRecord: Encodable, Sendable {
        case unavailable
        case functions([FunctionPlacement])

        enum CodingKeys: String, CodingKey { case functions }

        public func encode(to encoder: Encoder) throws {
            switch self {
            case .unavailable:
                var c = encoder.singleValueContainer()
                try c.encode("unavailable")
            case .functions(let rows):
                var c = encoder.container(keyedBy: CodingKeys.self)
                try c.encode(rows, forKey: .functions)
            }
        }

        public var isUnavailable: Bool { if case .unavailable = self { return true } else { return false } }
    }

    /// One window as the bench records it: token ids (eos included), stop reason, per-stage warm timings.
    public struct WindowRecord: Encodable, Sendable {
        public var index: Int
        public var startSeconds: Double
        public var endSeconds: Double
        public var tokenIds: [Int]
        public var text: String
        public var truncated: Bool
        public var stopReason: String
        public var encoderFunction: String
        public var featuresSeconds: Double
        public var encoderSeconds: Double
        public var promptSeconds: Double
        public var decodeSeconds: Double
        public var decoderCalls: Int
        public var msPerDecoderCall: Double

        enum CodingKeys: String, CodingKey {
            case index, startSeconds = "start_s", endSeconds = "end_s", tokenIds = "token_ids", text, truncated,
                 stopReason = "stop_reason", encoderFunction = "encoder_function", featuresSeconds = "features_s",
                 encoderSeconds = "encoder_s", promptSeconds = "prompt_s", decodeSeconds = "decode_s",
                 decoderCalls = "decoder_calls", msPerDecoderCall = "ms_per_decoder_call"
        }
    }

    /// One dataset entry's run. status: "ok" | "silent" (empty transcript, no model call) | "problem" (see `problem`).
    public struct ClipRecord: Encodable, Sendable {
        public var index: Int
        public var id: String
        public var file: String?
        public var language: String
        public var promptLanguage: String
        public var status = "ok"
        public var problem: String?
        public var audioSeconds: Double?
        public var processingSeconds: Double?
        public var hypothesis: String?
        /// Per window (eos included when reached).
        public var tokenIds: [[Int]]?
        public var stopReasons: [String]?
        /// Tokens emitted, eos excluded.
        public var tokens: Int?
        public var windows: [WindowRecord]?
        public var memoryMB: Double?

        enum CodingKeys: String, CodingKey {
            case index, id, file, language, promptLanguage = "prompt_language", status, problem, audioSeconds = "audio_s",
                 processingSeconds = "processing_s", hypothesis, tokenIds = "token_ids", stopReasons = "stop_reasons",
                 tokens, windows, memoryMB = "memory_mb"
        }

        mutating func fill(_ r: TranscriptionResult, eos: Set<Int>) {
            status = r.silent ? "silent" : "ok"
            audioSeconds = r.seconds
            hypothesis = r.text
            windows = r.windows.map { w in
                let t = w.timings
                return WindowRecord(index: w.index, startSeconds: w.startSeconds, endSeconds: w.startSeconds + w.durationSeconds,
                                    tokenIds: w.tokenIds, text: w.text, truncated: w.truncated,
                                    stopReason: stopReasonName(w.stopReason), encoderFunction: t.encoderFunction,
                                    featuresSeconds: t.featuresSeconds, encoderSeconds: t.encoderSeconds,
                                    promptSeconds: t.promptSeconds, decodeSeconds: t.decodeSeconds,
                                    decoderCalls: t.decoderCalls, msPerDecoderCall: t.msPerDecoderCall)
            }
            tokenIds = windows?.map(\.tokenIds)
            stopReasons = windows?.map(\.stopReason)
            tokens = windows?.reduce(0) { $0 + $1.tokenIds.filter { !eos.contains($0) }.count }
        }
    }

    /// Sums over the clips scored (ok and silent), as `cohere-coreml bench` sums them.
    public struct Totals: Encodable, Sendable {
        public var clips: Int
        public var clipsOK: Int
        public var clipsSilent: Int
        public var clipsFailed: Int
        public var windows: Int
        public var audioSeconds: Double
        public var processingSeconds: Double
        /// Audio seconds / transcription seconds (warm runs).
        public var rtfx: Double?
        public var stages: [String: Double]
        /// Emitted tokens, eos excluded.
        public var decodeTokens: Int
        /// decodeTokens / (prompt + decode seconds).
        public var tokensPerSecond: Double?
        public var decoderCalls: Int
        public var msPerDecoderCall: Double?

        enum CodingKeys: String, CodingKey {
            case clips, clipsOK = "clips_ok", clipsSilent = "clips_silent", clipsFailed = "clips_failed", windows,
                 audioSeconds = "audio_s", processingSeconds = "processing_s", rtfx, stages = "stages_s",
                 decodeTokens = "decode_tokens", tokensPerSecond = "tokens_per_s", decoderCalls = "decoder_calls",
                 msPerDecoderCall = "ms_per_decoder_call"
        }

        init(_ clips: [ClipRecord]) {
            let scored = clips.filter { $0.status != "problem" }
            let windows = scored.flatMap { $0.windows ?? [] }
            self.clips = clips.count
            clipsOK = clips.filter { $0.status == "ok" }.count
            clipsSilent = clips.filter { $0.status == "silent" }.count
            clipsFailed = clips.count - scored.count
            self.windows = windows.count
            audioSeconds = scored.reduce(0) { $0 + ($1.audioSeconds ?? 0) }
            processingSeconds = scored.reduce(0) { $0 + ($1.processingSeconds ?? 0) }
            rtfx = processingSeconds > 0 ? audioSeconds / processingSeconds : nil
            stages = ["features_s": windows.reduce(0) { $0 + $1.featuresSeconds },
                      "encoder_s": windows.reduce(0) { $0 + $1.encoderSeconds },
                      "prompt_s": windows.reduce(0) { $0 + $1.promptSeconds },
                      "decode_s": windows.reduce(0) { $0 + $1.decodeSeconds }]
            decodeTokens = scored.reduce(0) { $0 + ($1.tokens ?? 0) }
            let generation = stages["prompt_s"]! + stages["decode_s"]!
            tokensPerSecond = generation > 0 ? Double(decodeTokens) / generation : nil
            decoderCalls = windows.reduce(0) { $0 + $1.decoderCalls }
            msPerDecoderCall = decoderCalls > 0 ? 1000 * generation / Double(decoderCalls) : nil
        }
    }
}

/// The stop reason as its wire name, whether `WindowResult.stopReason` is a String or a String-valued enum.
func stopReasonName(_ reason: String) -> String { reason }
func stopReasonName<T: RawRepresentable>(_ reason: T) -> String where T.RawValue == String { reason.rawValue }

/// Monotonic lap timer.
struct Stopwatch {
    private var last = ContinuousClock.now

    /// Seconds since the previous lap (or creation).
    @discardableResult
    mutating func lap() -> Double {
        let now = ContinuousClock.now
        let d = last.duration(to: now)
        last = now
        return Double(d.components.seconds) + Double(d.components.attoseconds) * 1e-18
    }
}
