import Foundation

/// Element types of the arrays the bundle's packages exchange.
public enum DType: String, Codable, Sendable {
    case float32, float16, int32

    public var byteSize: Int { self == .float16 ? 2 : 4 }
}

/// A dense array: raw little-endian bytes in C (row-major) order, its element type and shape.
///
/// float16 values are kept as raw IEEE half bits and converted with `float16ToFloat` (exact), so no
/// Swift `Float16` is needed (it does not exist on Intel Macs).
public struct Tensor: Sendable, Equatable {
    public let dtype: DType
    public let shape: [Int]
    public let data: Data

    public var count: Int { shape.reduce(1, *) }

    public init(dtype: DType, shape: [Int], data: Data) throws {
        let expected = shape.reduce(1, *) * dtype.byteSize
        guard shape.allSatisfy({ $0 >= 0 }), data.count == expected else {
            throw TranscriptionError.invalidArray(
                "\(dtype.rawValue) array of shape \(shape) needs \(expected) bytes, got \(data.count)")
        }
        self.dtype = dtype
        self.shape = shape
        self.data = data
    }

    public init(float32 values: [Float], shape: [Int]) throws {
        let data = values.withUnsafeBufferPointer { Data(buffer: $0) }
        try self.init(dtype: .float32, shape: shape, data: data)
    }

    public init(int32 values: [Int32], shape: [Int]) throws {
        let data = values.withUnsafeBufferPointer { Data(buffer: $0) }
        try self.init(dtype: .int32, shape: shape, data: data)
    }

    /// Values as Float (float16 and int32 converted exactly).
    public func floats() -> [Float] {
        switch dtype {
        case .float32:
            return data.withUnsafeBytes { Array($0.bindMemory(to: Float.self)) }
        case .float16:
            return data.withUnsafeBytes { raw in raw.bindMemory(to: UInt16.self).map(float16ToFloat) }
        case .int32:
            return data.withUnsafeBytes { raw in raw.bindMemory(to: Int32.self).map(Float.init) }
        }
    }

    /// The first `length` entries of the last axis (a copy; `length` at most the axis size).
    public func croppingLastAxis(to length: Int) throws -> Tensor {
        guard let last = shape.last, length >= 0, length <= last else {
            throw TranscriptionError.invalidArray("cannot crop the last axis of \(shape) to \(length)")
        }
        if length == last { return self }
        let rows = count / max(last, 1)
        let rowBytes = last * dtype.byteSize, keep = length * dtype.byteSize
        var out = Data(capacity: rows * keep)
        data.withUnsafeBytes { raw in
            for r in 0..<rows { out.append(contentsOf: raw[(r * rowBytes)..<(r * rowBytes + keep)]) }
        }
        return try Tensor(dtype: dtype, shape: Array(shape.dropLast()) + [length], data: out)
    }

    /// The same values as float16 (a float32 array rounded to nearest, ties to even; float16 unchanged).
    public func asFloat16() throws -> Tensor {
        switch dtype {
        case .float16: return self
        case .float32:
            let bits = floats().map(floatToFloat16)
            return try Tensor(dtype: .float16, shape: shape, data: bits.withUnsafeBufferPointer { Data(buffer: $0) })
        case .int32: throw TranscriptionError.invalidArray("an int32 array has no float16 form")
        }
    }

    /// A host-state decoder's cache mask: float16 (1, 1, 1, capacity), 0 for the slots 0..<filled, -1e4 for
    /// the others (Python's `decoder_runtime.host_cache_mask`).
    public static func cacheMask(filled: Int, capacity: Int) throws -> Tensor {
        let open = floatToFloat16(0), closed = floatToFloat16(-1e4)
        let bits = (0..<capacity).map { $0 < filled ? open : closed }
        return try Tensor(dtype: .float16, shape: [1, 1, 1, capacity], data: bits.withUnsafeBufferPointer { Data(buffer: $0) })
    }

    /// Values as Int32 (only for int32 arrays).
    public func int32s() -> [Int32] {
        precondition(dtype == .int32, "int32s() of a \(dtype.rawValue) array")
        return data.withUnsafeBytes { Array($0.bindMemory(to: Int32.self)) }
    }
}

/// IEEE 754 half (raw bits) -> Float, exact for every value (subnormals, inf, NaN included).
@inline(__always)
public func float16ToFloat(_ bits: UInt16) -> Float {
    let sign = UInt32(bits & 0x8000) << 16
    let exponent = Int((bits >> 10) & 0x1F)
    let mantissa = UInt32(bits & 0x03FF)
    if exponent == 0 {
        // zero or subnormal: mantissa * 2^-24
        let magnitude = Float(mantissa) * Float(sign: .plus, exponent: -24, significand: 1)
        return sign != 0 ? -magnitude : magnitude
    }
    if exponent == 0x1F {
        return Float(bitPattern: sign | 0x7F80_0000 | (mantissa << 13))
    }
    return Float(bitPattern: sign | (UInt32(exponent - 15 + 127) << 23) | (mantissa << 13))
}

/// Float -> IEEE 754 half (raw bits), rounded to nearest, ties to even (as numpy's astype(float16)); overflow
/// gives inf, NaN stays NaN.
@inline(__always)
public func floatToFloat16(_ value: Float) -> UInt16 {
    let bits = value.bitPattern
    let sign = UInt16((bits >> 16) & 0x8000)
    let exponent = Int((bits >> 23) & 0xFF)
    var mantissa = bits & 0x7F_FFFF
    if exponent == 0xFF { return sign | 0x7C00 | (mantissa != 0 ? 0x200 : 0) }  // inf, NaN
    let e = exponent - 127 + 15
    if e >= 0x1F { return sign | 0x7C00 }  // too large: inf
    if e <= 0 {  // a half subnormal (or zero)
        if e < -10 { return sign }
        mantissa |= 0x80_0000  // the implicit bit
        let shift = UInt32(14 - e)
        var half = mantissa >> shift
        let rest = mantissa & ((1 << shift) - 1), midway = UInt32(1) << (shift - 1)
        if rest > midway || (rest == midway && half & 1 == 1) { half += 1 }
        return sign | UInt16(half)
    }
    var half = (UInt32(e) << 10) | (mantissa >> 13)
    let rest = mantissa & 0x1FFF
    if rest > 0x1000 || (rest == 0x1000 && half & 1 == 1) { half += 1 }  // a carry into the exponent is right
    return sign | UInt16(half)
}
