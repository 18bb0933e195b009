import Foundation
#if canImport(CoreML)
import CoreML
#endif

/// Runs packages with Core ML (macOS 15 / iOS 18): each `.mlpackage` is compiled to `.mlmodelc` on first
/// use and cached (next to the bundle when it is writable, else in Caches), recompiled when the package
/// changes; states come from `MLModel.makeState()` and predictions from `prediction(from:using:)`.
///
/// Float16 arrays are exchanged as raw bits (`Tensor`), never as Swift's `Float16`, which Intel Macs lack.
/// On Linux this file compiles against `CoreMLMirror.swift` (declarations only) and is never executed.
public final class CoreMLRuntime: ModelRuntime, @unchecked Sendable {
    public let name = "coreml"
    /// Folder of compiled models (nil: `<bundle>/.compiled`, or Caches when the bundle is read-only).
    public let cacheDirectory: URL?

    public init(cacheDirectory: URL? = nil) {
        self.cacheDirectory = cacheDirectory
    }

    public func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        let compiled = try await compiledModel(for: package)
        let configuration = MLModelConfiguration()
        configuration.computeUnits = computeUnits.coreML
        if let functionName { configuration.functionName = functionName }
        let model: MLModel
        do {
            model = try MLModel(contentsOf: compiled, configuration: configuration)
        } catch {
            throw TranscriptionError.runtime("Core ML cannot load \(package.lastPathComponent)"
                + (functionName.map { " function '\($0)'" } ?? "") + ": \(error.localizedDescription)")
        }
        return CoreMLModel(model: model, functionName: functionName ?? "main")
    }

    /// A fingerprint of the package's files (relative path, size, modification time).
    static func fingerprint(of package: URL) -> String {
        var parts: [String] = []
        let keys: [URLResourceKey] = [.fileSizeKey, .contentModificationDateKey, .isRegularFileKey]
        if let files = FileManager.default.enumerator(at: package, includingPropertiesForKeys: keys) {
            for case let url as URL in files {
                guard let values = try? url.resourceValues(forKeys: Set(keys)), values.isRegularFile == true else { continue }
                let relative = url.path.replacingOccurrences(of: package.path, with: "")
                parts.append("\(relative)|\(values.fileSize ?? 0)|\(values.contentModificationDate?.timeIntervalSince1970 ?? 0)")
            }
        }
        return parts.sorted().joined(separator: "\n")
    }

    func cacheFolder(for package: URL) -> URL {
        if let cacheDirectory { return cacheDirectory }
        let besideBundle = package.deletingLastPathComponent().appendingPathComponent(".compiled")
        if FileManager.default.isWritableFile(atPath: package.deletingLastPathComponent().path) { return besideBundle }
        let caches = FileManager.default.urls(for: .cachesDirectory, in: .userDomainMask)[0]
        let tag = String(package.deletingLastPathComponent().path.hashValue, radix: 16)
        return caches.appendingPathComponent("CohereTranscribe").appendingPathComponent(tag)
    }

    /// The compiled model of `package`: the cached one when its stamp matches, else compiled now (the
    /// first Neural Engine load of a large encoder takes minutes) and moved into the cache atomically.
    func compiledModel(for package: URL) async throws -> URL {
        guard FileManager.default.fileExists(atPath: package.path) else {
            throw BundleError.missingFile("model package not found: \(package.path)")
        }
        let folder = cacheFolder(for: package)
        let name = package.deletingPathExtension().lastPathComponent
        let target = folder.appendingPathComponent(name + ".mlmodelc")
        let stamp = folder.appendingPathComponent(name + ".stamp")
        let fingerprint = CoreMLRuntime.fingerprint(of: package)
        if FileManager.default.fileExists(atPath: target.path),
           (try? String(contentsOf: stamp, encoding: .utf8)) == fingerprint {
            return target
        }
        let temporary: URL
        do {
            temporary = try await MLModel.compileModel(at: package)
        } catch {
            throw TranscriptionError.runtime("Core ML cannot compile \(package.lastPathComponent): \(error.localizedDescription)")
        }
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        try? FileManager.default.removeItem(at: target)
        try FileManager.default.moveItem(at: temporary, to: target)
        try fingerprint.write(to: stamp, atomically: true, encoding: .utf8)
        return target
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
}

final class CoreMLModel: RuntimeModel {
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
                    out[name] = ArrayDescription(shape: c.bufferShape.map(\.intValue), dtype: CoreMLModel.dtypeName(c.dataType))
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

    func predict(_ inputs: [String: Tensor], state: RuntimeState?) throws -> [String: Tensor] {
        var features: [String: Any] = [:]
        for (name, tensor) in inputs { features[name] = MLFeatureValue(multiArray: try CoreMLModel.multiArray(tensor)) }
        let provider = try MLDictionaryFeatureProvider(dictionary: features)
        let result: MLFeatureProvider
        do {
            if let state {
                guard let s = state as? CoreMLState else {
                    throw TranscriptionError.invalidArgument("a state of another runtime was passed to Core ML")
                }
                result = try model.prediction(from: provider, using: s.state)
            } else {
                result = try model.prediction(from: provider)
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

    static func tensor(_ a: MLMultiArray) throws -> Tensor {
        let dtype: DType
        switch a.dataType {
        case .float32: dtype = .float32
        case .float16: dtype = .float16
        case .int32: dtype = .int32
        default: throw TranscriptionError.badOutput("Core ML output of unsupported type \(a.dataType.rawValue)")
        }
        let shape = a.shape.map(\.intValue)
        var data = Data(count: shape.reduce(1, *) * dtype.byteSize)
        a.withUnsafeBytes { raw in
            data.withUnsafeMutableBytes { dst in
                gatherStrided(from: raw, strides: a.strides.map { $0.intValue * dtype.byteSize }, shape: shape,
                              elementSize: dtype.byteSize, into: dst)
            }
        }
        return try Tensor(dtype: dtype, shape: shape, data: data)
    }
}

/// Copies a dense C-order tensor into a (possibly padded) strided buffer.
func copyStrided(from t: Tensor, into raw: UnsafeMutableRawBufferPointer, strides: [Int]) {
    let size = t.dtype.byteSize
    t.data.withUnsafeBytes { src in
        forEachIndex(shape: t.shape) { linear, index in
            let offset = zip(index, strides).reduce(0) { $0 + $1.0 * $1.1 }
            raw.baseAddress!.advanced(by: offset).copyMemory(from: src.baseAddress!.advanced(by: linear * size), byteCount: size)
        }
    }
}

/// Gathers a strided buffer into a dense C-order one.
func gatherStrided(from raw: UnsafeRawBufferPointer, strides: [Int], shape: [Int], elementSize: Int,
                   into dst: UnsafeMutableRawBufferPointer) {
    forEachIndex(shape: shape) { linear, index in
        let offset = zip(index, strides).reduce(0) { $0 + $1.0 * $1.1 }
        dst.baseAddress!.advanced(by: linear * elementSize).copyMemory(from: raw.baseAddress!.advanced(by: offset),
                                                                     byteCount: elementSize)
    }
}

/// Calls `body(linear, multi-index)` for every element of `shape` in C order.
func forEachIndex(shape: [Int], _ body: (Int, [Int]) -> Void) {
    let count = shape.reduce(1, *)
    guard count > 0 else { return }
    var index = [Int](repeating: 0, count: shape.count)
    for linear in 0..<count {
        body(linear, index)
        var axis = shape.count - 1
        while axis >= 0 {
            index[axis] += 1
            if index[axis] < shape[axis] { break }
            index[axis] = 0
            axis -= 1
        }
    }
}
