import Foundation

// Copies between dense C-order tensors and strided (possibly padded) array buffers: Core ML arrays
// (`CoreMLRuntime`) and the Linux Core ML emulation's outputs.

/// Copies a dense C-order tensor into a (possibly padded) strided buffer; `strides` in bytes.
func copyStrided(from t: Tensor, into raw: UnsafeMutableRawBufferPointer, strides: [Int]) {
    let size = t.dtype.byteSize
    t.data.withUnsafeBytes { src in
        forEachRow(shape: t.shape, strides: strides, elementSize: size) { dense, strided, bytes, step in
            if step == size {
                raw.baseAddress!.advanced(by: strided).copyMemory(from: src.baseAddress!.advanced(by: dense), byteCount: bytes)
            } else {
                for i in 0..<(bytes / size) {
                    raw.baseAddress!.advanced(by: strided + i * step)
                        .copyMemory(from: src.baseAddress!.advanced(by: dense + i * size), byteCount: size)
                }
            }
        }
    }
}

/// Gathers a strided buffer (`strides` in bytes) into a dense C-order one.
func gatherStrided(from raw: UnsafeRawBufferPointer, strides: [Int], shape: [Int], elementSize: Int,
                   into dst: UnsafeMutableRawBufferPointer) {
    forEachRow(shape: shape, strides: strides, elementSize: elementSize) { dense, strided, bytes, step in
        if step == elementSize {
            dst.baseAddress!.advanced(by: dense).copyMemory(from: raw.baseAddress!.advanced(by: strided), byteCount: bytes)
        } else {
            for i in 0..<(bytes / elementSize) {
                dst.baseAddress!.advanced(by: dense + i * elementSize)
                    .copyMemory(from: raw.baseAddress!.advanced(by: strided + i * step), byteCount: elementSize)
            }
        }
    }
}

/// Calls `body(dense byte offset, strided byte offset, row bytes, last-axis byte stride)` once per row
/// (the last axis) of `shape` in C order: one memcpy per row when the last axis is contiguous.
func forEachRow(shape: [Int], strides: [Int], elementSize: Int, _ body: (Int, Int, Int, Int) -> Void) {
    let count = shape.reduce(1, *)
    guard count > 0 else { return }
    guard let last = shape.last else {  // a scalar
        body(0, 0, elementSize, elementSize)
        return
    }
    let rowBytes = last * elementSize
    let lastStride = strides.last ?? elementSize
    let outer = Array(shape.dropLast())
    var index = [Int](repeating: 0, count: outer.count)
    for row in 0..<(count / last) {
        var offset = 0
        for (i, s) in zip(index, strides) { offset += i * s }
        body(row * rowBytes, offset, rowBytes, lastStride)
        var axis = outer.count - 1
        while axis >= 0 {
            index[axis] += 1
            if index[axis] < outer[axis] { break }
            index[axis] = 0
            axis -= 1
        }
    }
}
