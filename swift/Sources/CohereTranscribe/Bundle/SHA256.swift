import Foundation

/// SHA-256 (FIPS 180-4) in pure Swift: CryptoKit is not available on Linux. Used to verify bundle
/// files against the manifest's `checksums` table.
///
/// ```swift
/// var h = SHA256()
/// h.update(chunk1); h.update(chunk2)
/// let hex = h.finalize().hexString
/// ```
public struct SHA256 {
    private static let k: [UInt32] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    ]

    private var h: (UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32) =
        (0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19)
    /// Bytes of an incomplete block (fewer than 64) waiting for more input.
    private var buffer = [UInt8](repeating: 0, count: 64)
    private var bufferCount = 0
    /// Total message length in bytes.
    private var length: UInt64 = 0

    /// A fresh hash state.
    public init() {}

    /// Feeds `data` into the hash.
    public mutating func update(_ data: Data) {
        data.withUnsafeBytes { update(bytes: $0) }
    }

    /// Feeds the bytes of `bytes` into the hash.
    public mutating func update(bytes: UnsafeRawBufferPointer) {
        var count = bytes.count
        guard count > 0, var p = bytes.baseAddress else { return }
        length &+= UInt64(count)
        if bufferCount > 0 {
            let take = min(64 - bufferCount, count), offset = bufferCount, src = p
            buffer.withUnsafeMutableBytes { b in
                (b.baseAddress! + offset).copyMemory(from: src, byteCount: take)
            }
            bufferCount += take
            p += take
            count -= take
            if bufferCount < 64 { return }
            var state = h
            buffer.withUnsafeBytes { b in Self.compress(&state, b.baseAddress!, blocks: 1) }
            h = state
            bufferCount = 0
        }
        let blocks = count / 64
        if blocks > 0 {
            Self.compress(&h, p, blocks: blocks)
            p += blocks * 64
            count -= blocks * 64
        }
        if count > 0 {
            let src = p, n = count
            buffer.withUnsafeMutableBytes { b in b.baseAddress!.copyMemory(from: src, byteCount: n) }
            bufferCount = count
        }
    }

    /// The 32-byte digest of everything fed so far (the state itself is not changed).
    public func finalize() -> [UInt8] {
        var state = h
        var tail = [UInt8](repeating: 0, count: 128)
        for i in 0..<bufferCount { tail[i] = buffer[i] }
        tail[bufferCount] = 0x80
        let total = bufferCount + 1 + 8 <= 64 ? 64 : 128
        let bits = length &* 8
        for i in 0..<8 { tail[total - 1 - i] = UInt8(truncatingIfNeeded: bits >> (8 * UInt64(i))) }
        tail.withUnsafeBytes { b in Self.compress(&state, b.baseAddress!, blocks: total / 64) }
        var out = [UInt8](repeating: 0, count: 32)
        let words = [state.0, state.1, state.2, state.3, state.4, state.5, state.6, state.7]
        for (i, w) in words.enumerated() {
            out[4 * i] = UInt8(truncatingIfNeeded: w >> 24)
            out[4 * i + 1] = UInt8(truncatingIfNeeded: w >> 16)
            out[4 * i + 2] = UInt8(truncatingIfNeeded: w >> 8)
            out[4 * i + 3] = UInt8(truncatingIfNeeded: w)
        }
        return out
    }

    /// The digest of `data`.
    public static func hash(_ data: Data) -> [UInt8] {
        var s = SHA256()
        s.update(data)
        return s.finalize()
    }

    /// The digest of `data` as 64 lowercase hex digits.
    public static func hexDigest(_ data: Data) -> String {
        hash(data).hexString
    }

    /// The digest of the file at `url` as 64 lowercase hex digits, read in 1 MiB chunks.
    public static func hexDigest(ofFile url: URL) throws -> String {
        let handle = try FileHandle(forReadingFrom: url)
        defer { try? handle.close() }
        var s = SHA256()
        while true {
            let chunk = try handle.read(upToCount: 1 << 20) ?? Data()
            if chunk.isEmpty { break }
            s.update(chunk)
        }
        return s.finalize().hexString
    }

    @inline(__always) private static func rotr(_ x: UInt32, _ n: UInt32) -> UInt32 {
        (x >> n) | (x << (32 &- n))
    }

    /// Runs the compression function over `blocks` consecutive 64-byte blocks at `p`.
    private static func compress(_ h: inout (UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, UInt32),
                                 _ p: UnsafeRawPointer, blocks: Int) {
        k.withUnsafeBufferPointer { k in
            withUnsafeTemporaryAllocation(of: UInt32.self, capacity: 64) { w in
                var block = p
                for _ in 0..<blocks {
                    for t in 0..<16 {
                        w[t] = UInt32(bigEndian: block.loadUnaligned(fromByteOffset: 4 * t, as: UInt32.self))
                    }
                    for t in 16..<64 {
                        let x = w[t - 15], y = w[t - 2]
                        let s0 = rotr(x, 7) ^ rotr(x, 18) ^ (x >> 3)
                        let s1 = rotr(y, 17) ^ rotr(y, 19) ^ (y >> 10)
                        w[t] = w[t - 16] &+ s0 &+ w[t - 7] &+ s1
                    }
                    var a = h.0, b = h.1, c = h.2, d = h.3, e = h.4, f = h.5, g = h.6, hh = h.7
                    for t in 0..<64 {
                        let S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)
                        let ch = (e & f) ^ (~e & g)
                        let t1 = hh &+ S1 &+ ch &+ k[t] &+ w[t]
                        let S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)
                        let maj = (a & b) ^ (a & c) ^ (b & c)
                        let t2 = S0 &+ maj
                        hh = g; g = f; f = e; e = d &+ t1
                        d = c; c = b; b = a; a = t1 &+ t2
                    }
                    h.0 &+= a; h.1 &+= b; h.2 &+= c; h.3 &+= d
                    h.4 &+= e; h.5 &+= f; h.6 &+= g; h.7 &+= hh
                    block += 64
                }
            }
        }
    }
}

extension Array where Element == UInt8 {
    /// The bytes as lowercase hex digits, two per byte.
    var hexString: String {
        let digits: [UInt8] = Array("0123456789abcdef".utf8)
        var out = [UInt8]()
        out.reserveCapacity(count * 2)
        for b in self {
            out.append(digits[Int(b >> 4)])
            out.append(digits[Int(b & 0x0f)])
        }
        return String(decoding: out, as: UTF8.self)
    }
}
