// DECLARATION-ONLY MIRROR OF THE FEW CORE ML TYPES `CoreMLRuntime.swift` USES.
//
// Built only where Core ML does not exist (Linux), so that CoreMLRuntime.swift type-checks there
// against the signatures Apple documents. Nothing here is ever executed: every body traps with
// `fatalError`, and `CohereTranscriber` never picks `CoreMLRuntime` on such a platform. On macOS and
// iOS this file compiles to nothing and the real `import CoreML` is used.
#if !canImport(CoreML)
import Foundation

private func unavailable(_ what: String = #function) -> Never {
    fatalError("Core ML mirror: \(what) called on a platform without Core ML (declarations only)")
}

enum MLComputeUnits: Int, Sendable {
    case cpuOnly = 0, cpuAndGPU = 1, all = 2, cpuAndNeuralEngine = 3
}

enum MLMultiArrayDataType: Int, Sendable {
    case double = 65600, float64 = 65601, float32 = 65568, float16 = 65552, float = 65569, int32 = 131104, int8 = 131080
}

class MLModelConfiguration {
    var computeUnits: MLComputeUnits = .all
    var functionName: String?
    init() {}
}

class MLMultiArray {
    var shape: [NSNumber] { unavailable() }
    var strides: [NSNumber] { unavailable() }
    var dataType: MLMultiArrayDataType { unavailable() }
    init(shape: [NSNumber], dataType: MLMultiArrayDataType) throws { unavailable() }
    func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R { unavailable() }
    func withUnsafeMutableBytes<R>(_ body: (UnsafeMutableRawBufferPointer, [Int]) throws -> R) rethrows -> R {
        unavailable()
    }
}

class MLFeatureValue {
    init(multiArray: MLMultiArray) { unavailable() }
    var multiArrayValue: MLMultiArray? { unavailable() }
}

protocol MLFeatureProvider {
    var featureNames: Set<String> { get }
    func featureValue(for featureName: String) -> MLFeatureValue?
}

class MLDictionaryFeatureProvider: MLFeatureProvider {
    init(dictionary: [String: Any]) throws { unavailable() }
    var featureNames: Set<String> { unavailable() }
    func featureValue(for featureName: String) -> MLFeatureValue? { unavailable() }
}

class MLMultiArrayConstraint {
    var shape: [NSNumber] { unavailable() }
    var dataType: MLMultiArrayDataType { unavailable() }
}

class MLStateConstraint {
    var bufferShape: [NSNumber] { unavailable() }
    var dataType: MLMultiArrayDataType { unavailable() }
}

class MLFeatureDescription {
    var multiArrayConstraint: MLMultiArrayConstraint? { unavailable() }
    var stateConstraint: MLStateConstraint? { unavailable() }
}

class MLModelDescription {
    var inputDescriptionsByName: [String: MLFeatureDescription] { unavailable() }
    var outputDescriptionsByName: [String: MLFeatureDescription] { unavailable() }
    var stateDescriptionsByName: [String: MLFeatureDescription] { unavailable() }
}

class MLState {}

class MLModel {
    init(contentsOf url: URL, configuration: MLModelConfiguration) throws { unavailable() }
    class func compileModel(at modelURL: URL) async throws -> URL { unavailable() }
    var modelDescription: MLModelDescription { unavailable() }
    func makeState() -> MLState { unavailable() }
    func prediction(from input: MLFeatureProvider) throws -> MLFeatureProvider { unavailable() }
    func prediction(from input: MLFeatureProvider, using state: MLState) throws -> MLFeatureProvider { unavailable() }
}
#endif
