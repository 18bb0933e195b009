// The Core ML runtime: macOS 15 / iOS 18 with Apple's Core ML; on Linux the same source runs on the
// executable emulation in CoreMLEmulation.swift (same declarations as the SDK), so it is tested there.
// Not built for tvOS, watchOS or visionOS (the package declares no minimum for them).
#if os(macOS) || os(iOS) || os(Linux)
import Foundation
#if os(macOS) || os(iOS)
import CoreML
#endif

/// Runs packages with Core ML: each `.mlpackage` is compiled once to `.mlmodelc` and cached in a folder
/// of the app's Caches (never inside the bundle: an app's resources are signed and read-only), under
/// a name derived from the package's content (the manifest's sha256 checksums of its files, else its
/// file table: path, size, modification time), so every later launch loads the cached model instead of
/// recompiling (a Neural Engine compile of the full-size encoder takes minutes). Concurrent loads of one
/// package share one compile; the folder's rules (installs that never delete a complete model, the
/// upkeep after an install, list / clear / prune) are `CompiledModelCache`'s, the same as Python's.
/// Loads and predictions use Core ML's async APIs.
///
/// Float16 arrays are exchanged as raw bits (`Tensor`), never as Swift's `Float16`, which Intel Macs lack.
/// `@unchecked Sendable`: its only mutable state (the compile / cache counters) is behind `counts`.
public final class CoreMLRuntime: ModelRuntime, @unchecked Sendable {
    public let name = "coreml"
    /// Folder of compiled models: by default `<Caches>/CohereTranscribe/compiled`.
    public let cacheDirectory: URL
    /// The folder's rules and size cap.
    public let cache: CompiledModelCache
    private let counts = NSLock()
    private var compiled: Set<String> = [], cached: Set<String> = []

    /// Packages this runtime compiled, and packages it found already compiled in the cache.
    public var cacheStatistics: (compiled: Int, fromCache: Int) {
        counts.lock(); defer { counts.unlock() }
        return (compiled.count, cached.subtracting(compiled).count)
    }

    private func count(_ target: URL, compiled isNew: Bool) {
        counts.lock(); defer { counts.unlock() }
        if isNew { compiled.insert(target.path) } else { cached.insert(target.path) }
    }

    /// `cacheDirectory`: where compiled models are kept (default: the user's Caches). A folder inside
    /// the app bundle is refused (writing there breaks the app's code signature). `maxCacheBytes`: the
    /// size cap kept after each install (nil: none).
    public init(cacheDirectory: URL? = nil, maxCacheBytes: Int? = CompiledModelCache.defaultMaxBytes) throws {
        let folder = cacheDirectory ?? CoreMLRuntime.defaultCacheDirectory()
        try CoreMLRuntime.checkOutsideAppBundle(folder)
        self.cacheDirectory = folder
        self.cache = CompiledModelCache(folder: folder, maxBytes: maxCacheBytes)
    }

    /// The cache's entries (compiled models and interrupted installs' leftovers), least recently used first.
    public func cacheEntries() -> [CompiledCacheEntry] { cache.entries() }

    /// Removes every cache entry (not a live process's install under way); returns what was removed.
    @discardableResult
    public func clearCache() -> [CompiledCacheEntry] { cache.clear() }

    /// Removes cache entries: per package name all but the `keepPerPackage` most recently used, those unused
    /// for `olderThan` seconds, the least recently used while the folder holds more than `maxBytes`.
    @discardableResult
    public func pruneCache(keepPerPackage: Int? = nil, olderThan: TimeInterval? = nil,
                           maxBytes: Int? = nil) -> [CompiledCacheEntry] {
        cache.prune(keep: keepPerPackage, olderThan: olderThan, maxBytes: maxBytes)
    }

    public static func defaultCacheDirectory() -> URL {
        let caches = FileManager.default.urls(for: .cachesDirectory, in: .userDomainMask).first
            ?? URL(fileURLWithPath: NSTemporaryDirectory())
        return caches.appendingPathComponent("CohereTranscribe").appendingPathComponent("compiled")
    }

    static func checkOutsideAppBundle(_ folder: URL) throws {
        #if os(macOS) || os(iOS)
        let app = Bundle.main.bundleURL.standardizedFileURL.resolvingSymlinksInPath().path
        let target = folder.standardizedFileURL.resolvingSymlinksInPath().path
        if Bundle.main.bundleURL.pathExtension == "app", target == app || target.hasPrefix(app + "/") {
            throw TranscriptionError.invalidArgument(
                "compiled models cannot be cached inside the app bundle (\(folder.path)): it breaks the app's signature; use Caches or Application Support")
        }
        #endif
    }

    public func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        let compiled = try await compiledModel(for: package)
        let configuration = MLModelConfiguration()
        configuration.computeUnits = computeUnits.coreML
        if let functionName { configuration.functionName = functionName }
        let model: MLModel
        do {
            model = try await MLModel.load(contentsOf: compiled, configuration: configuration)
        } catch {
            throw TranscriptionError.runtime("Core ML cannot load \(package.lastPathComponent)"
                + (functionName.map { " function '\($0)'" } ?? "") + ": \(error.localizedDescription)")
        }
        return CoreMLModel(model: model, functionName: functionName ?? "main")
    }

    // MARK: compiled-model cache

    /// A stable digest of `package`'s content (hex sha256, the same in every process): from the bundle
    /// manifest's checksums of the package's files when the manifest beside it has them, else from the
    /// package's file table (relative path, size, modification time).
    static func digest(of package: URL) throws -> String {
        let prefix = package.lastPathComponent + "/"
        var lines: [String] = []
        let manifest = package.deletingLastPathComponent().appendingPathComponent("manifest.json")
        if let data = try? Data(contentsOf: manifest),
           let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
           let files = (object["checksums"] as? [String: Any])?["files"] as? [String: [String: Any]] {
            for (path, entry) in files where path.hasPrefix(prefix) {
                lines.append("\(path)\t\(entry["sha256"] as? String ?? "")\t\(entry["size"] as? Int ?? -1)")
            }
        }
        if lines.isEmpty {
            lines = try fileTable(of: package).map { "\($0.path)\t\($0.size)\t\($0.modified)" }
        }
        return SHA256.hexDigest(Data(lines.sorted().joined(separator: "\n").utf8))
    }

    static func fileTable(of package: URL) throws -> [(path: String, size: Int, modified: Double)] {
        let keys: [URLResourceKey] = [.fileSizeKey, .contentModificationDateKey, .isRegularFileKey]
        guard let files = FileManager.default.enumerator(at: package, includingPropertiesForKeys: keys) else {
            throw BundleError.missingFile("model package not readable: \(package.path)")
        }
        let root = package.standardizedFileURL.path
        var out: [(String, Int, Double)] = []
        for case let url as URL in files {
            let values = try url.resourceValues(forKeys: Set(keys))
            guard values.isRegularFile == true else { continue }
            let path = url.standardizedFileURL.path
            let relative = path.hasPrefix(root + "/") ? String(path.dropFirst(root.count + 1)) : path
            out.append((package.lastPathComponent + "/" + relative, values.fileSize ?? 0,
                        values.contentModificationDate?.timeIntervalSince1970 ?? 0))
        }
        return out.sorted { $0.0 < $1.0 }
    }

    /// Where the compiled model of `package` is cached: `<cache>/<name>-<digest prefix>.mlmodelc`.
    func cachedLocation(for package: URL) throws -> URL {
        let name = package.deletingPathExtension().lastPathComponent
        return cacheDirectory.appendingPathComponent("\(name)-\(try CoreMLRuntime.digest(of: package).prefix(24)).mlmodelc")
    }

    /// The compiled model of `package`: the cached one, else compiled now and moved into the cache
    /// atomically. Callers that ask for the same package while it compiles wait for that one compile.
    func compiledModel(for package: URL) async throws -> URL {
        guard FileManager.default.fileExists(atPath: package.path) else {
            throw BundleError.missingFile("model package not found: \(package.path)")
        }
        let target = try cachedLocation(for: package)
        if CompiledModelCache.isComplete(target) {
            CompiledModelCache.touch(target)
            count(target, compiled: false)
            return target
        }
        return try await CompileRegistry.shared.compiled(target: target) { [self] in
            if CompiledModelCache.isComplete(target) {  // installed by a compile that finished meanwhile
                CompiledModelCache.touch(target)
                count(target, compiled: false)
                return target
            }
            let temporary: URL
            do {
                temporary = try await MLModel.compileModel(at: package)
            } catch {
                throw TranscriptionError.runtime("Core ML cannot compile \(package.lastPathComponent): \(error.localizedDescription)")
            }
            if try CompiledModelCache.install(temporary, at: target, source: package) {
                cache.afterInstall(target: target, source: package)
            }
            count(target, compiled: true)
            return target
        }
    }
}

/// One compile per cached target in this process: callers that arrive while it compiles await the
/// same task; once it is done the task is dropped (later callers find the cache entry on disk, and a
/// failed or since-deleted entry is compiled again).
actor CompileRegistry {
    static let shared = CompileRegistry()
    private var tasks: [String: Task<URL, Error>] = [:]

    func compiled(target: URL, _ work: @escaping @Sendable () async throws -> URL) async throws -> URL {
        let key = target.path
        if let task = tasks[key] { return try await task.value }
        let task = Task { try await work() }
        tasks[key] = task
        defer { tasks[key] = nil }
        return try await task.value
    }
}

extension ComputeUnits {
    var coreML: MLComputeUnits {
        switch self {
        case .all: return .all
        case .cpuOnly: return .cpuOnly
        case .cpuAndGPU: return .cpuAndGPU
        case .cpuAndNeuralEngine: return .cpuAndNeuralEngine
        }
    }
}

final class CoreMLState: RuntimeState {
    let state: MLState
    init(_ state: MLState) { self.state = state }

    /// The region written through the state buffer's mutable view (`MLState.withMultiArray(for:)`, through
    /// its strides): only `value`'s bytes are touched (one K/V row per layer for a decode step).
    func write(_ name: String, _ value: Tensor, at start: [Int]) throws -> Int {
        try state.withMultiArray(for: name) { array in
            let shape = array.shape.map(\.intValue)
            let dtype: DType? = array.dataType == .float16 ? .float16 : array.dataType == .float32 ? .float32
                : array.dataType == .int32 ? .int32 : nil
            guard dtype == value.dtype, start.count == shape.count, value.shape.count == shape.count,
                  zip(zip(start, value.shape), shape).allSatisfy({ $0.0 >= 0 && $0.0 + $0.1 <= $1 }) else {
                throw TranscriptionError.invalidArgument(
                    "cannot write a \(value.dtype.rawValue) \(value.shape) array at \(start) into the state '\(name)' "
                        + "(\(shape), \(CoreMLModel.dtypeName(array.dataType)))")
            }
            let size = value.dtype.byteSize
            let strides = array.strides.map { $0.intValue * size }
            let offset = zip(start, strides).reduce(0) { $0 + $1.0 * $1.1 }
            array.withUnsafeMutableBytes { raw, _ in
                copyStrided(from: value, into: UnsafeMutableRawBufferPointer(rebasing: raw[offset...]), strides: strides)
            }
            return value.data.count
        }
    }
}

/// `@unchecked Sendable` (RuntimeModel is Sendable): `MLModel` is not Sendable in the SDK (MLModel.h:
/// `ML_EXPORT @interface MLModel : NSObject`, no NS_SWIFT_SENDABLE), but this wrapper only reads its immutable
/// `modelDescription` (in `init`) and calls `prediction(from:options:) async` / `makeState()`; Core ML's async
/// prediction API is documented as thread-safe for concurrent calls (WWDC23 "Improve Core ML integration with
/// async prediction"). The arrays, providers and options of a call stay inside that call.
final class CoreMLModel: RuntimeModel, @unchecked Sendable {
    let model: MLModel
    let functionName: String
    let io: ModelIO

    init(model: MLModel, functionName: String) {
        self.model = model
        self.functionName = functionName
        let d = model.modelDescription
        func arrays(_ features: [String: MLFeatureDescription]) -> [String: ArrayDescription] {
            var out: [String: ArrayDescription] = [:]
            for (name, f) in features {
                if let c = f.multiArrayConstraint {
                    out[name] = ArrayDescription(shape: c.shape.map(\.intValue), dtype: CoreMLModel.dtypeName(c.dataType))
                } else if let c = f.stateConstraint {
                    out[name] = ArrayDescription(shape: c.bufferShape, dtype: CoreMLModel.dtypeName(c.dataType))
                }
            }
            return out
        }
        io = ModelIO(inputs: arrays(d.inputDescriptionsByName), outputs: arrays(d.outputDescriptionsByName),
                     states: arrays(d.stateDescriptionsByName))
    }

    static func dtypeName(_ t: MLMultiArrayDataType) -> String {
        switch t {
        case .float32: return "float32"
        case .float16: return "float16"
        case .int32: return "int32"
        case .double: return "float64"
        default: return "unknown"
        }
    }

    func makeState() throws -> RuntimeState { CoreMLState(model.makeState()) }

    func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
        var features: [String: Any] = [:]
        for (name, tensor) in inputs { features[name] = MLFeatureValue(multiArray: try CoreMLModel.multiArray(tensor)) }
        let provider = try MLDictionaryFeatureProvider(dictionary: features)
        let result: MLFeatureProvider
        do {
            if let state {
                guard let s = state as? CoreMLState else {
                    throw TranscriptionError.invalidArgument("a state of another runtime was passed to Core ML")
                }
                result = try await model.prediction(from: provider, using: s.state, options: MLPredictionOptions())
            } else {
                result = try await model.prediction(from: provider, options: MLPredictionOptions())
            }
        } catch let error as TranscriptionError {
            throw error
        } catch {
            throw TranscriptionError.runtime("Core ML prediction (function '\(functionName)') failed: \(error.localizedDescription)")
        }
        var out: [String: Tensor] = [:]
        for name in result.featureNames {
            if let array = result.featureValue(for: name)?.multiArrayValue { out[name] = try CoreMLModel.tensor(array) }
        }
        return out
    }

    static func multiArray(_ t: Tensor) throws -> MLMultiArray {
        let type: MLMultiArrayDataType = t.dtype == .float32 ? .float32 : t.dtype == .float16 ? .float16 : .int32
        let array = try MLMultiArray(shape: t.shape.map { NSNumber(value: $0) }, dataType: type)
        array.withUnsafeMutableBytes { raw, strides in
            copyStrided(from: t, into: raw, strides: strides.map { $0 * t.dtype.byteSize })
        }
        return array
    }

    /// A dense tensor of `a`'s elements, read through its strides (Neural Engine outputs may pad rows).
    static func tensor(_ a: MLMultiArray) throws -> Tensor {
        let dtype: DType
        switch a.dataType {
        case .float32: dtype = .float32
        case .float16: dtype = .float16
        case .int32: dtype = .int32
        default: throw TranscriptionError.badOutput("Core ML output of unsupported type \(a.dataType.rawValue)")
        }
        let shape = a.shape.map(\.intValue)
        let strides = a.strides.map { $0.intValue * dtype.byteSize }
        var data = Data(count: shape.reduce(1, *) * dtype.byteSize)
        a.withUnsafeBytes { raw in
            data.withUnsafeMutableBytes { dst in
                gatherStrided(from: raw, strides: strides, shape: shape, elementSize: dtype.byteSize, into: dst)
            }
        }
        return try Tensor(dtype: dtype, shape: shape, data: data)
    }
}
#endif
