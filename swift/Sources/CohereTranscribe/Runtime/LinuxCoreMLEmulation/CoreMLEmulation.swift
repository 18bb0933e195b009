// AN EXECUTABLE EMULATION OF THE CORE ML SUBSET THIS PACKAGE USES, FOR LINUX.
//
// Follows the declarations of Apple's iOS 18.3 / macOS 15 SDK: the Objective-C headers of
// CoreML.framework (MLModel.h, MLModel+MLState.h, MLState.h, MLMultiArray.h, MLFeatureValue.h,
// MLFeatureDescription.h, MLMultiArrayConstraint.h, MLStateConstraint.h, MLModelConfiguration.h,
// MLModelDescription.h, MLDictionaryFeatureProvider.h) as Swift imports them, and the Swift overlay
// (CoreML.swiftmodule/arm64-apple-ios.swiftinterface, Swift 6.0.3): names, argument labels, types,
// optionality and availability are the SDK's. It declares only what the package uses; a call that the
// SDK does not have does not compile here either, so `CoreMLRuntime.swift` is the same source on Linux,
// macOS and iOS (it imports CoreML on Apple platforms and compiles against this file on Linux).
//
// Properties the SDK declares read-only are read-only here too (`private(set)`).
// Sendable as the SDK declares it: of the classes only `MLState` (MLState.h: `ML_EXPORT NS_SWIFT_SENDABLE
// __attribute__((objc_subclassing_restricted)) @interface MLState : NSObject`); every other class here is
// `ML_EXPORT @interface MLx : NSObject...` with no NS_SWIFT_SENDABLE (MLModel.h, MLModelConfiguration.h,
// MLPredictionOptions.h, MLMultiArray.h, MLFeatureValue.h, MLDictionaryFeatureProvider.h,
// MLFeatureDescription.h, MLModelDescription.h, MLMultiArrayConstraint.h, MLStateConstraint.h of the iOS
// 18.3 SDK), so not Sendable: code that sends one across isolation domains fails here as it would on a
// device build. The NS_ENUMs (MLComputeUnits, MLMultiArrayDataType, MLFeatureType) import as Sendable.
// Behaviour, as on a device:
// - `MLModel.compileModel(at:)` returns a temporary `<name>.mlmodelc` folder that is deleted when the
//   process exits unless the caller moves it; `MLModel(contentsOf:configuration:)` and `MLModel.load`
//   accept compiled models only (as Core ML: an `.mlpackage` must be compiled first).
// - `MLModelConfiguration.functionName` selects a function of a multifunction package.
// - Predictions run in the project's MIL interpreter (`cohere-coreml serve-runtime`, given once with
//   `CoreMLEmulation.use(_:)`); states are the interpreter's state buffers.
// - Output arrays have padded, non-contiguous strides on purpose (the Neural Engine can return rows
//   padded to 64 bytes): code that reads an `MLMultiArray` as if it were dense fails here.
// Figures the emulation keeps for tests (compiles, loads, predictions, bytes bound per prediction) are
// in `CoreMLEmulation.statistics`.
#if os(Linux)
import Foundation

// MARK: - emulation control (not part of Core ML)

/// Settings and counters of the Linux Core ML emulation (not a Core ML API).
public enum CoreMLEmulation {
    public struct Statistics: Sendable, Equatable {
        public var compiles = 0
        public var loads = 0
        public var predictions = 0
        /// Bytes of the input arrays passed to the last prediction of each function.
        public var inputBytesByFunction: [String: Int] = [:]
        /// `MLState.withMultiArray(for:)` calls (the host's writes into a state).
        public var stateViews = 0
    }

    nonisolated(unsafe) private static var interpreter: InterpreterRuntime?
    nonisolated(unsafe) private static var stats = Statistics()
    private static let lock = NSLock()

    /// The interpreter that runs the emulated models (one `serve-runtime` child for every model).
    public static func use(_ runtime: InterpreterRuntime) {
        lock.lock(); defer { lock.unlock() }
        interpreter = runtime
    }

    public static var statistics: Statistics {
        lock.lock(); defer { lock.unlock() }
        return stats
    }

    static func record(_ change: (inout Statistics) -> Void) {
        lock.lock(); defer { lock.unlock() }
        change(&stats)
    }

    static func backend() throws -> InterpreterRuntime {
        lock.lock(); defer { lock.unlock() }
        guard let interpreter else {
            throw emulationError(1, "the Core ML emulation has no interpreter: call CoreMLEmulation.use(InterpreterRuntime(...)) first")
        }
        return interpreter
    }

    /// This process's folder of temporary compiled models (removed at exit, as the system's temporary
    /// compile results are).
    static let temporaryRoot: URL = {
        let root = URL(fileURLWithPath: NSTemporaryDirectory())
            .appendingPathComponent("coreml-emulation-\(ProcessInfo.processInfo.processIdentifier)-\(UUID().uuidString)")
        try? FileManager.default.createDirectory(at: root, withIntermediateDirectories: true)
        atexit { try? FileManager.default.removeItem(at: CoreMLEmulation.temporaryRoot) }
        return root
    }()

    /// Row stride (in elements) of an emulated output whose last axis has `length` elements: padded to
    /// the next multiple of 64 bytes, and always at least one element more than the row.
    static func paddedRow(_ length: Int, elementSize: Int) -> Int {
        let perLine = max(64 / elementSize, 1)
        return ((length + 1 + perLine - 1) / perLine) * perLine
    }

    static let marker = "coreml-emulation.json"
    /// How long an emulated compile suspends its caller.
    static let compileDelayNanoseconds: UInt64 = 200_000_000
}

func emulationError(_ code: Int, _ message: String) -> NSError {
    NSError(domain: "com.apple.CoreML", code: code, userInfo: [NSLocalizedDescriptionKey: message])
}

// MARK: - enums

/// `MLComputeUnits` (MLModelConfiguration.h). `.cpuAndNeuralEngine`: macOS 13 / iOS 16.
public enum MLComputeUnits: Int, Sendable {
    case cpuOnly = 0
    case cpuAndGPU = 1
    case all = 2
    @available(macOS 13.0, iOS 16.0, watchOS 9.0, tvOS 16.0, *)
    case cpuAndNeuralEngine = 3
}

/// `MLMultiArrayDataType` (MLMultiArray.h). `float64` and `float` are aliases of `double` and `float32`
/// in the SDK (imported as static properties, not cases; macOS 11 / iOS 14); `float16`: macOS 12 / iOS 16
/// (`MLMultiArrayDataTypeFloat16 API_AVAILABLE(macos(12.0), ios(16.0), watchos(9.0), tvos(16.0))`);
/// `int8`: macOS 26 / iOS 26.
public enum MLMultiArrayDataType: Int, Sendable {
    case double = 65600
    case float32 = 65568
    @available(macOS 12.0, iOS 16.0, watchOS 9.0, tvOS 16.0, *)
    case float16 = 65552
    case int32 = 131104
    @available(macOS 26.0, iOS 26.0, watchOS 26.0, tvOS 26.0, visionOS 26.0, *)
    case int8 = 131080

    @available(macOS 11.0, iOS 14.0, watchOS 7.0, tvOS 14.0, *)
    public static var float64: MLMultiArrayDataType { .double }
    @available(macOS 11.0, iOS 14.0, watchOS 7.0, tvOS 14.0, *)
    public static var float: MLMultiArrayDataType { .float32 }
}

/// `MLFeatureType` (MLFeatureType.h).
public enum MLFeatureType: Int, Sendable {
    case invalid = 0, int64 = 1, double = 2, string = 3, image = 4, multiArray = 5, dictionary = 6, sequence = 7
    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    case state = 8
}

extension MLMultiArrayDataType {
    var emulatedDType: DType? {
        switch self {
        case .float32: return .float32
        case .float16: return .float16
        case .int32: return .int32
        default: return nil
        }
    }

    var elementSize: Int {
        switch self {
        case .double: return 8
        case .float32, .int32: return 4
        case .float16: return 2
        case .int8: return 1
        }
    }

    init?(emulated name: String) {
        switch name {
        case "float32": self = .float32
        case "float16": self = .float16
        case "int32": self = .int32
        case "float64": self = .double
        default: return nil
        }
    }
}

// MARK: - configuration, options

@available(macOS 10.14, iOS 12.0, watchOS 5.0, tvOS 12.0, *)
open class MLModelConfiguration: NSObject, NSCopying {
    open var computeUnits: MLComputeUnits = .all
    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    open var functionName: String?
    open var modelDisplayName: String?

    public override init() { super.init() }

    open func copy(with zone: NSZone? = nil) -> Any {
        let c = MLModelConfiguration()
        c.computeUnits = computeUnits
        c.functionName = functionName
        c.modelDisplayName = modelDisplayName
        return c
    }
}

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLPredictionOptions: NSObject {
    public override init() { super.init() }
}

// MARK: - MLMultiArray

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLMultiArray: NSObject {
    private let storage: UnsafeMutableRawBufferPointer
    private let shapeValues: [Int]
    private let strideValues: [Int]

    public private(set) var dataType: MLMultiArrayDataType
    open var shape: [NSNumber] { shapeValues.map { NSNumber(value: $0) } }
    /// In elements: the element at index i is at offset sum(i[d] * strides[d]).
    open var strides: [NSNumber] { strideValues.map { NSNumber(value: $0) } }
    open var count: Int { shapeValues.reduce(1, *) }

    /// C-contiguous (MLMultiArray.h `initWithShape:dataType:error:`).
    public init(shape: [NSNumber], dataType: MLMultiArrayDataType) throws {
        let dims = shape.map(\.intValue)
        guard dims.allSatisfy({ $0 > 0 }) else {
            throw emulationError(2, "MLMultiArray shape \(dims) has a non-positive dimension")
        }
        var strides = [Int](repeating: 1, count: dims.count)
        for axis in stride(from: dims.count - 2, through: 0, by: -1) { strides[axis] = strides[axis + 1] * dims[axis + 1] }
        self.dataType = dataType
        self.shapeValues = dims
        self.strideValues = strides
        self.storage = MLMultiArray.allocate(shape: dims, strides: strides, elementSize: dataType.elementSize)
        super.init()
    }

    /// Swift overlay, macOS 15 / iOS 18: an array with the given strides (in elements).
    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public convenience init(shape: [Int], dataType: MLMultiArrayDataType, strides: [Int]) {
        self.init(validatedShape: shape, dataType: dataType, strides: strides)
    }

    private init(validatedShape shape: [Int], dataType: MLMultiArrayDataType, strides: [Int]) {
        precondition(shape.count == strides.count && shape.allSatisfy { $0 > 0 } && strides.allSatisfy { $0 > 0 },
                     "MLMultiArray(shape:dataType:strides:) needs one positive stride per positive dimension")
        self.dataType = dataType
        self.shapeValues = shape
        self.strideValues = strides
        self.storage = MLMultiArray.allocate(shape: shape, strides: strides, elementSize: dataType.elementSize)
        super.init()
    }

    private static func allocate(shape: [Int], strides: [Int], elementSize: Int) -> UnsafeMutableRawBufferPointer {
        let span = zip(shape, strides).reduce(1) { $0 + ($1.0 - 1) * $1.1 }
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: max(span * elementSize, 1), alignment: 64)
        buffer.initializeMemory(as: UInt8.self, repeating: 0)
        return buffer
    }

    deinit { storage.deallocate() }

    @available(macOS 12.3, iOS 15.4, watchOS 8.5, tvOS 15.4, *)
    public func withUnsafeBytes<R>(_ body: (_ ptr: UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        try body(UnsafeRawBufferPointer(storage))
    }

    @available(macOS 12.3, iOS 15.4, watchOS 8.5, tvOS 15.4, *)
    public func withUnsafeMutableBytes<R>(_ body: (_ ptr: UnsafeMutableRawBufferPointer, _ strides: [Int]) throws -> R) rethrows -> R {
        try body(storage, strideValues)
    }

    /// A dense C-order copy of the elements (emulation helper).
    func denseData() -> Data {
        let size = dataType.elementSize
        var out = Data(count: count * size)
        out.withUnsafeMutableBytes { dst in
            gatherStrided(from: UnsafeRawBufferPointer(storage), strides: strideValues.map { $0 * size }, shape: shapeValues,
                          elementSize: size, into: dst)
        }
        return out
    }

    /// An output array with padded rows holding `tensor` (emulation helper).
    static func padded(_ tensor: Tensor) -> MLMultiArray {
        let type: MLMultiArrayDataType = tensor.dtype == .float32 ? .float32 : tensor.dtype == .float16 ? .float16 : .int32
        let shape = tensor.shape.isEmpty ? [1] : tensor.shape.map { max($0, 1) }
        var strides = [Int](repeating: 1, count: shape.count)
        if let last = shape.last {
            var step = CoreMLEmulation.paddedRow(last, elementSize: type.elementSize)
            for axis in stride(from: shape.count - 2, through: 0, by: -1) {
                strides[axis] = step
                step *= shape[axis]
            }
        }
        let array = MLMultiArray(validatedShape: shape, dataType: type, strides: strides)
        array.withUnsafeMutableBytes { raw, strides in
            copyStrided(from: tensor, into: raw, strides: strides.map { $0 * type.elementSize })
        }
        return array
    }
}

// MARK: - feature values and providers

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLFeatureValue: NSObject {
    public private(set) var type: MLFeatureType
    public private(set) var multiArrayValue: MLMultiArray?

    public init(multiArray: MLMultiArray) {
        self.type = .multiArray
        self.multiArrayValue = multiArray
        super.init()
    }
}

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
public protocol MLFeatureProvider: NSObjectProtocol {
    var featureNames: Set<String> { get }
    func featureValue(for featureName: String) -> MLFeatureValue?
}

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLDictionaryFeatureProvider: NSObject, MLFeatureProvider {
    public private(set) var dictionary: [String: MLFeatureValue]

    /// Values are `MLFeatureValue`s or what `MLFeatureValue` wraps (here: `MLMultiArray`).
    public init(dictionary: [String: Any]) throws {
        var values: [String: MLFeatureValue] = [:]
        for (name, value) in dictionary {
            if let v = value as? MLFeatureValue {
                values[name] = v
            } else if let a = value as? MLMultiArray {
                values[name] = MLFeatureValue(multiArray: a)
            } else {
                throw emulationError(3, "MLDictionaryFeatureProvider: value for '\(name)' is not a feature value")
            }
        }
        self.dictionary = values
        super.init()
    }

    open var featureNames: Set<String> { Set(dictionary.keys) }
    open func featureValue(for featureName: String) -> MLFeatureValue? { dictionary[featureName] }
    open subscript(featureName: String) -> MLFeatureValue? { dictionary[featureName] }
}

// MARK: - descriptions

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLMultiArrayConstraint: NSObject {
    public private(set) var shape: [NSNumber]
    public private(set) var dataType: MLMultiArrayDataType
    init(shape: [Int], dataType: MLMultiArrayDataType) {
        self.shape = shape.map { NSNumber(value: $0) }
        self.dataType = dataType
    }
}

@available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
open class MLStateConstraint: NSObject {
    /// `[Int]` in Swift (the Objective-C `bufferShape` is refined for Swift by the overlay).
    public private(set) var bufferShape: [Int]
    public private(set) var dataType: MLMultiArrayDataType
    init(bufferShape: [Int], dataType: MLMultiArrayDataType) {
        self.bufferShape = bufferShape
        self.dataType = dataType
    }
}

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLFeatureDescription: NSObject {
    public private(set) var name: String
    public private(set) var type: MLFeatureType
    open var isOptional: Bool { false }
    public private(set) var multiArrayConstraint: MLMultiArrayConstraint?
    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public private(set) var stateConstraint: MLStateConstraint?

    init(name: String, array: MLMultiArrayConstraint? = nil, state: MLStateConstraint? = nil) {
        self.name = name
        self.type = state != nil ? .state : .multiArray
        self.multiArrayConstraint = array
        self.stateConstraint = state
    }
}

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLModelDescription: NSObject {
    public private(set) var inputDescriptionsByName: [String: MLFeatureDescription]
    public private(set) var outputDescriptionsByName: [String: MLFeatureDescription]
    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public private(set) var stateDescriptionsByName: [String: MLFeatureDescription]

    init(inputs: [String: MLFeatureDescription], outputs: [String: MLFeatureDescription],
         states: [String: MLFeatureDescription]) {
        self.inputDescriptionsByName = inputs
        self.outputDescriptionsByName = outputs
        self.stateDescriptionsByName = states
    }
}

// MARK: - state

/// `MLState` (MLState.h: `NS_SWIFT_SENDABLE`, `objc_subclassing_restricted`: final and Sendable): the
/// state buffers of one stateful model instance. Checked Sendable: immutable, its backend is Sendable.
@available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
public final class MLState: NSObject, Sendable {
    let handle: String
    let backend: InterpreterRuntime
    let modelHandle: String

    init(handle: String, backend: InterpreterRuntime, modelHandle: String) {
        self.handle = handle
        self.backend = backend
        self.modelHandle = modelHandle
    }

    deinit { _ = try? backend.call(["op": "free", "state": handle]) }
}

// The Swift overlay's declaration (CoreML.swiftmodule/arm64-apple-ios.swiftinterface of the iOS 18.3 SDK,
// Swift 6.0.3; public copy: github.com/xybp888/iOS-SDKs, iPhoneOS18.3.sdk/System/Library/Frameworks/
// CoreML.framework/Modules/CoreML.swiftmodule/arm64-apple-ios.swiftinterface):
//   @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, *)
//   extension CoreML.MLState {
//     @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, *)
//     public func withMultiArray<R>(for stateName: Swift.String, _ body: (CoreML.MLMultiArray) throws -> R) rethrows -> R
//   }
// It refines MLState.h's `-getMultiArrayForStateNamed:handler:` ("Gets a mutable view into a state buffer. The
// underlying state buffer's address can differ for each call; one shall not access the state buffer outside
// of the closure"). Also in the developer documentation: developer.apple.com/documentation/coreml/mlstate/
// withmultiarray(for:_:).
@available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, *)
extension MLState {
    /// A mutable view of the state buffer `stateName`, valid inside `body` only. Emulated: the buffer is read
    /// from the interpreter into a padded array (its address differs at each call, as the SDK warns), `body`
    /// runs on it, and what `body` leaves in it is written back whole; on a device only the bytes `body`
    /// writes change.
    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, *)
    public func withMultiArray<R>(for stateName: String, _ body: (MLMultiArray) throws -> R) rethrows -> R {
        let array: MLMultiArray
        let dtype: DType
        let shape: [Int]
        do {
            let (_, arrays) = try backend.call(["op": "read_state", "state": handle, "name": stateName])
            guard let t = arrays[stateName] else { throw emulationError(4, "no state named '\(stateName)'") }
            array = MLMultiArray.padded(t)
            (dtype, shape) = (t.dtype, t.shape)
        } catch {
            preconditionFailure("MLState.withMultiArray(for: \(stateName)): \(error)")  // Core ML's cannot fail either
        }
        let result = try body(array)
        do {
            let value = try Tensor(dtype: dtype, shape: shape, data: array.denseData())
            _ = try backend.call(["op": "write_state", "state": handle, "name": stateName], arrays: [(stateName, value)])
        } catch {
            preconditionFailure("MLState.withMultiArray(for: \(stateName)): writing the buffer back: \(error)")
        }
        CoreMLEmulation.record { $0.stateViews += 1 }
        return result
    }
}

// MARK: - model

@available(macOS 10.13, iOS 11.0, watchOS 4.0, tvOS 11.0, *)
open class MLModel: NSObject {
    public private(set) var modelDescription: MLModelDescription
    @available(macOS 10.14, iOS 12.0, watchOS 5.0, tvOS 12.0, *)
    public private(set) var configuration: MLModelConfiguration
    private let handle: String
    private let backend: InterpreterRuntime
    private let function: String

    /// Loads a compiled model (`.mlmodelc`), the function `configuration.functionName` (default: main).
    @available(macOS 10.14, iOS 12.0, watchOS 5.0, tvOS 12.0, *)
    public init(contentsOf url: URL, configuration: MLModelConfiguration) throws {
        let marker = url.appendingPathComponent(CoreMLEmulation.marker)
        guard url.pathExtension == "mlmodelc", let data = try? Data(contentsOf: marker),
              let info = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
              let packageName = info["package"] as? String else {
            throw emulationError(5, "\(url.path) is not a compiled model (.mlmodelc): compile it with MLModel.compileModel(at:)")
        }
        let backend = try CoreMLEmulation.backend()
        var request: [String: Any] = ["op": "load", "path": url.appendingPathComponent(packageName).path,
                                      "compute_units": configuration.computeUnits.emulatedName]
        if let name = configuration.functionName { request["function"] = name }
        let (reply, _) = try backend.call(request)
        guard let handle = reply["model"] as? String, let function = reply["function"] as? String else {
            throw emulationError(6, "bad load reply for \(url.lastPathComponent)")
        }
        func features(_ key: String, states: Bool) throws -> [String: MLFeatureDescription] {
            var out: [String: MLFeatureDescription] = [:]
            for (name, value) in reply[key] as? [String: [String: Any]] ?? [:] {
                let dims = value["shape"] as? [Int] ?? []
                guard let type = MLMultiArrayDataType(emulated: value["dtype"] as? String ?? "") else {
                    throw emulationError(7, "\(url.lastPathComponent): \(name) has a type the emulation does not know")
                }
                out[name] = states
                    ? MLFeatureDescription(name: name, state: MLStateConstraint(bufferShape: dims, dataType: type))
                    : MLFeatureDescription(name: name, array: MLMultiArrayConstraint(shape: dims, dataType: type))
            }
            return out
        }
        self.modelDescription = MLModelDescription(inputs: try features("inputs", states: false),
                                                   outputs: try features("outputs", states: false),
                                                   states: try features("states", states: true))
        self.configuration = configuration.copy() as! MLModelConfiguration
        self.handle = handle
        self.backend = backend
        self.function = function
        super.init()
        CoreMLEmulation.record { $0.loads += 1 }
    }

    deinit { _ = try? backend.call(["op": "free", "model": handle]) }

    @available(macOS 12.0, iOS 15.0, watchOS 8.0, tvOS 15.0, *)
    public class func load(contentsOf url: URL, configuration: MLModelConfiguration = MLModelConfiguration()) async throws -> MLModel {
        try MLModel(contentsOf: url, configuration: configuration)
    }

    /// Compiles `url` (an `.mlpackage`) into a temporary `.mlmodelc` that disappears (at process exit
    /// here) unless the caller moves it.
    @available(macOS 13.0, iOS 16.0, tvOS 16.0, *)
    @available(watchOS, unavailable)
    public class func compileModel(at url: URL) async throws -> URL {
        var isDirectory: ObjCBool = false
        guard url.pathExtension == "mlpackage", FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory),
              isDirectory.boolValue, FileManager.default.fileExists(atPath: url.appendingPathComponent("Manifest.json").path) else {
            throw emulationError(8, "cannot compile \(url.path): not a model package (.mlpackage with Manifest.json)")
        }
        // a device compile takes seconds to minutes: suspend, so concurrent callers really overlap here
        try await Task.sleep(nanoseconds: CoreMLEmulation.compileDelayNanoseconds)
        let folder = CoreMLEmulation.temporaryRoot.appendingPathComponent(UUID().uuidString)
        let compiled = folder.appendingPathComponent(url.deletingPathExtension().lastPathComponent + ".mlmodelc")
        try FileManager.default.createDirectory(at: compiled, withIntermediateDirectories: true)
        try FileManager.default.copyItem(at: url, to: compiled.appendingPathComponent("model.mlpackage"))
        let marker = try JSONSerialization.data(withJSONObject: ["package": "model.mlpackage", "source": url.lastPathComponent])
        try marker.write(to: compiled.appendingPathComponent(CoreMLEmulation.marker))
        CoreMLEmulation.record { $0.compiles += 1 }
        return compiled
    }

    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public func makeState() -> MLState {
        do {
            let (reply, _) = try backend.call(["op": "make_state", "model": handle])
            guard let state = reply["state"] as? String else { throw emulationError(9, "bad make_state reply") }
            return MLState(handle: state, backend: backend, modelHandle: handle)
        } catch {
            preconditionFailure("MLModel.makeState(): \(error)")  // Core ML's makeState() cannot fail either
        }
    }

    public func prediction(from input: MLFeatureProvider) throws -> MLFeatureProvider {
        try run(input, state: nil)
    }

    public func prediction(from input: MLFeatureProvider, options: MLPredictionOptions) throws -> MLFeatureProvider {
        try run(input, state: nil)
    }

    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public func prediction(from inputFeatures: MLFeatureProvider, using state: MLState) throws -> MLFeatureProvider {
        try run(inputFeatures, state: state)
    }

    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public func prediction(from inputFeatures: MLFeatureProvider, using state: MLState,
                           options: MLPredictionOptions) throws -> MLFeatureProvider {
        try run(inputFeatures, state: state)
    }

    @available(macOS 14.0, iOS 17.0, watchOS 10.0, tvOS 17.0, *)
    public func prediction(from input: MLFeatureProvider,
                           options: MLPredictionOptions = MLPredictionOptions()) async throws -> MLFeatureProvider {
        try run(input, state: nil)
    }

    @available(macOS 15.0, iOS 18.0, watchOS 11.0, tvOS 18.0, visionOS 2.0, *)
    public func prediction(from input: MLFeatureProvider, using state: MLState,
                           options: MLPredictionOptions = MLPredictionOptions()) async throws -> MLFeatureProvider {
        try run(input, state: state)
    }

    private func run(_ input: MLFeatureProvider, state: MLState?) throws -> MLFeatureProvider {
        var arrays: [(String, Tensor)] = []
        for name in input.featureNames.sorted() {
            guard let array = input.featureValue(for: name)?.multiArrayValue else {
                throw emulationError(10, "input '\(name)' is not a multi-array")
            }
            guard let dtype = array.dataType.emulatedDType else {
                throw emulationError(11, "input '\(name)': data type \(array.dataType.rawValue) is not one the model declares")
            }
            arrays.append((name, try Tensor(dtype: dtype, shape: array.shape.map(\.intValue), data: array.denseData())))
        }
        var request: [String: Any] = ["op": "predict", "model": handle]
        if let state {
            guard state.backend === backend else { throw emulationError(12, "the state belongs to another runtime") }
            request["state"] = state.handle
        }
        let (_, outputs) = try backend.call(request, arrays: arrays)
        let bytes = arrays.reduce(0) { $0 + $1.1.data.count }
        CoreMLEmulation.record {
            $0.predictions += 1
            $0.inputBytesByFunction[function] = bytes
        }
        var values: [String: Any] = [:]
        for (name, tensor) in outputs { values[name] = MLFeatureValue(multiArray: MLMultiArray.padded(tensor)) }
        return try MLDictionaryFeatureProvider(dictionary: values)
    }
}

extension MLComputeUnits {
    var emulatedName: String {
        switch self {
        case .cpuOnly: return "cpu_only"
        case .cpuAndGPU: return "cpu_and_gpu"
        case .all: return "all"
        case .cpuAndNeuralEngine: return "cpu_and_ne"
        }
    }
}
#endif
