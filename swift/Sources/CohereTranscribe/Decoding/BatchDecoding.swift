import Foundation

/// The batched step of a host-state decoder as the batched loop sees it (`decoder.batch`; docs/bundle.md, "Decoding
/// several windows at once"): B rows on one state, each row one window (its cross memory, its cache, its position).
/// `RuntimeBatchDecoder` is the package's `step_batch` function; the tests replay the shared vectors on a scripted
/// one (Python: `batch_decoding.BatchDecoder` and the scripted decoder of tests/inference/test_batch_decoding.py).
public protocol BatchStepDecoder: AnyObject {
    /// What a window brings into a row (the encoder's outputs for the package).
    associatedtype Memory
    /// B, the rows of one call.
    var batch: Int { get }
    /// C, the cache slots of a row.
    var capacity: Int { get }
    /// Writes one window's memory into row `row` (its cross_k / cross_v heads and its cross_mask row); the row's cache
    /// is left as it is (its `cache_mask` hides it). Returns the bytes written into the state.
    func bindRow(_ row: Int, memory: Memory) async throws -> Int
    /// One call: each busy row's token at its position (a free row: position nil; it feeds `BatchDecoding.padToken` at
    /// slot 0 with every slot closed); writes each busy row's new K/V rows at its position. Returns B rows of log-probs
    /// (a free row's: not meaningful).
    func step(tokens: [Int], positions: [Int?]) async throws -> [[Float]]
}

/// One window's greedy decode in the batched loop (Python's `DecodeResult` of `decode_windows`).
public struct BatchWindowDecode: Sendable, Equatable {
    /// Generated ids (prompt excluded; the eos id included when reached).
    public var tokens: [Int]
    public var stopReason: StopReason
    /// Batched calls the window took part in (one token fed each).
    public var calls: Int
    /// Bytes its memory took when it entered its row.
    public var bindBytes: Int
    /// Writing its memory into its row, and its share of the calls (a call's time split over its busy rows).
    public var bindSeconds: Double
    public var promptSeconds: Double
    public var decodeSeconds: Double
    /// The log-probability of each emitted token at the call that chose it.
    public var tokenLogProbs: [Double]
}

/// The batched greedy loop of docs/bundle.md ("Decoding several windows at once"), a port of Python's
/// `batch_decoding.decode_windows`: rows start free; while a row is free and a window waits, the window enters the
/// row (its memory written into it, its position 0, its prompt queued). Every call, a busy row feeds its next prompt
/// token, else its last prediction, at its position (its cache mask opening the slots below it); a free row feeds
/// `padToken` at slot 0 with every slot closed. After the call each busy row's position moves on; once its prompt
/// is fed, the argmax of its log-probs (first index on ties) is its next token; eos or the token limit ends the
/// window, which leaves its row, refilled before the next call. A refilled row's cache is not cleared: its mask opens
/// only slots its own window wrote, so each window's tokens are the batch-1 loop's (`CohereTranscriber.decode`).
public enum BatchDecoding {
    /// The id a free row feeds (Python's `EXTEND_PAD_ID`); its output is never read.
    public static let padToken = 0

    /// New tokens a window may take and the stop reason when it takes them all, as the batch-1 loop: every fed token
    /// takes a slot and the last prediction is not fed, so capacity - prompt + 1, or `maxNewTokens` when smaller.
    public static func tokenLimit(promptLength: Int, capacity: Int, maxNewTokens: Int?) -> (limit: Int, reason: StopReason) {
        let limit = capacity - promptLength + 1
        if let maxNewTokens, maxNewTokens < limit { return (maxNewTokens, .maxNewTokens) }
        return (limit, .capacity)
    }

    struct Row {
        var key: Int
        var pending: [Int]  // prompt tokens still to feed
        var position = 0
        var last: Int?  // the last prediction, fed at the next call
        var tokens: [Int] = []
        var scores: [Double] = []
        var bindBytes = 0
        var bindSeconds = 0.0, promptSeconds = 0.0, decodeSeconds = 0.0
        var calls = 0

        init(key: Int, pending: [Int]) { (self.key, self.pending) = (key, pending) }

        var token: Int { pending.first ?? last ?? BatchDecoding.padToken }
    }

    /// Decodes the windows `next` hands out (key and memory; nil: none left), B at a time. `next` is asked only when a
    /// row is free, so at most B memories are held (a caller that encodes there encodes each window as it enters).
    /// `finished` gets each window as it ends (not in `next`'s order). Runs on the caller's actor (`isolation`): the
    /// decoder, its state and the closures stay in the caller's isolation domain.
    public static func decodeWindows<D: BatchStepDecoder>(
        _ decoder: D, prompt: [Int], eosIds: Set<Int>, maxNewTokens: Int? = nil,
        next: () async throws -> (key: Int, memory: D.Memory)?,
        finished: (Int, BatchWindowDecode) async throws -> Void,
        isolation: isolated (any Actor)? = #isolation
    ) async throws {
        let (batch, capacity) = (decoder.batch, decoder.capacity)
        guard batch >= 1 else { throw TranscriptionError.invalidArgument("a batched decoder of \(batch) rows") }
        guard !prompt.isEmpty, prompt.count < capacity else {
            throw TranscriptionError.invalidArgument("prompt of \(prompt.count) tokens does not fit the cache (\(capacity) slots)")
        }
        if let maxNewTokens, maxNewTokens < 1 {
            throw TranscriptionError.invalidArgument("maxNewTokens must be >= 1, got \(maxNewTokens)")
        }
        let (limit, reasonAtLimit) = tokenLimit(promptLength: prompt.count, capacity: capacity, maxNewTokens: maxNewTokens)
        var rows = [Row?](repeating: nil, count: batch)
        var exhausted = false

        func refill() async throws {
            for b in 0..<batch where rows[b] == nil {
                if exhausted { return }
                guard let (key, memory) = try await next() else {
                    exhausted = true
                    return
                }
                let t0 = Date()
                var row = Row(key: key, pending: prompt)  // position 0: the row's cache slots are its own again
                row.bindBytes = try await decoder.bindRow(b, memory: memory)
                row.bindSeconds = Date().timeIntervalSince(t0)
                rows[b] = row
            }
        }

        try await refill()
        while rows.contains(where: { $0 != nil }) {
            try Task.checkCancellation()
            let busy = rows.compactMap { $0 }.count
            let t0 = Date()
            let logProbs = try await decoder.step(tokens: rows.map { $0?.token ?? padToken }, positions: rows.map { $0?.position })
            guard logProbs.count == batch else {
                throw TranscriptionError.badOutput("the batched decoder returned \(logProbs.count) rows of log-probs, not \(batch)")
            }
            let share = Date().timeIntervalSince(t0) / Double(busy)
            for b in 0..<batch {
                guard var row = rows[b] else { continue }
                row.calls += 1
                row.position += 1
                if !row.pending.isEmpty {
                    row.pending.removeFirst()
                    row.promptSeconds += share
                    if !row.pending.isEmpty {  // a prediction inside the prompt: never read
                        rows[b] = row
                        continue
                    }
                } else {
                    row.decodeSeconds += share
                }
                let scores = logProbs[b]
                guard !scores.isEmpty else { throw TranscriptionError.badOutput("the batched decoder returned no log-probs for row \(b)") }
                var best = 0
                for (i, v) in scores.enumerated() {
                    guard v.isFinite else {
                        throw TranscriptionError.badOutput(
                            "decoder produced non-finite log-probs at position \(row.position - 1) (batch row \(b))")
                    }
                    if v > scores[best] { best = i }  // first index on ties, as numpy's argmax
                }
                row.tokens.append(best)
                row.scores.append(Double(scores[best]))
                let stop: StopReason? = eosIds.contains(best) ? .eos : row.tokens.count >= limit ? reasonAtLimit : nil
                guard let stop else {
                    row.last = best
                    rows[b] = row
                    continue
                }
                rows[b] = nil
                try await finished(row.key, BatchWindowDecode(
                    tokens: row.tokens, stopReason: stop, calls: row.calls, bindBytes: row.bindBytes,
                    bindSeconds: row.bindSeconds, promptSeconds: row.promptSeconds, decodeSeconds: row.decodeSeconds,
                    tokenLogProbs: row.scores))
            }
            try await refill()  // freed rows take waiting windows before the next call
        }
    }

    /// The inputs of one call (Python's `BatchDecoder.inputs`): `tokens[b]` at slot `positions[b]` for each busy row,
    /// its `cache_mask` row 0 for the slots below it and -1e4 for the others; a free row (position nil) feeds
    /// `padToken` at slot 0 with every slot closed. input_ids int32 (B, 1), position int32 (B), the mask fp16
    /// (B, 1, 1, C) under `cacheMask`.
    public static func inputs(tokens: [Int], positions: [Int?], batch: Int, capacity: Int,
                              cacheMask: String = "cache_mask") throws -> [String: Tensor] {
        guard tokens.count == batch, positions.count == batch else {
            throw TranscriptionError.invalidArgument(
                "the batched step takes \(batch) rows, got \(tokens.count) tokens and \(positions.count) positions")
        }
        var ids = [Int32](repeating: Int32(padToken), count: batch), slots = [Int32](repeating: 0, count: batch)
        let open = floatToFloat16(0), closed = floatToFloat16(-1e4)
        var mask = [UInt16](repeating: closed, count: batch * capacity)
        for (b, position) in positions.enumerated() {
            guard let position else { continue }
            guard (0..<capacity).contains(position) else {
                throw TranscriptionError.invalidArgument("row \(b): position \(position) is outside the cache (\(capacity) slots)")
            }
            ids[b] = Int32(tokens[b])
            slots[b] = Int32(position)
            for j in 0..<position { mask[b * capacity + j] = open }
        }
        return ["input_ids": try Tensor(int32: ids, shape: [batch, 1]),
                "position": try Tensor(int32: slots, shape: [batch]),
                cacheMask: try Tensor(dtype: .float16, shape: [batch, 1, 1, capacity],
                                      data: mask.withUnsafeBufferPointer { Data(buffer: $0) })]
    }
}

/// The decoder package's `step_batch` function and the host's writes into its rows (Python's
/// `batch_decoding.BatchDecoder`): one state of B rows for a whole clip, made here and used only by the task that
/// made it (the transcriber's actor), as every `MLState`. Writes go through `RuntimeState.write` (Core ML:
/// `MLState.withMultiArray(for:)`, only the region written).
final class RuntimeBatchDecoder: BatchStepDecoder {
    typealias Memory = [String: Tensor]
    let model: RuntimeModel
    let state: RuntimeState
    let batch: Int
    let capacity: Int
    let kvHeads: Int
    let vocabSize: Int
    let output: String
    let cacheMask: String
    /// State -> the encoder output written into a row once per window; state -> the output of each call's new rows.
    let memoryStates: [(state: String, output: String)]
    let rowOutputs: [(state: String, output: String)]
    /// Bytes one busy row's new K/V rows take in a call (every row output, fp16).
    private(set) var rowBytes = 0

    init(model: RuntimeModel, manifest: BundleManifest) throws {
        let d = manifest.decoder
        guard let size = d.batch?.size, size >= 1, d.hostWritesState, d.cacheShape.count == 4 else {
            throw TranscriptionError.invalidArgument("the bundle's decoder has no batched step (decoder.batch): "
                + "re-export it with `cohere-coreml export --decoder-batch 4`, or decode one window at a time")
        }
        (self.model, batch, capacity, kvHeads, vocabSize) = (model, size, d.capacity, d.cacheShape[1], d.vocabSize)
        output = d.output
        cacheMask = d.cacheMaskInput ?? "cache_mask"
        memoryStates = (d.memoryStates ?? [:]).sorted { $0.key < $1.key }.map { (state: $0.key, output: $0.value) }
        rowOutputs = (d.rowOutputs ?? [:]).sorted { $0.key < $1.key }.map { (state: $0.key, output: $0.value) }
        state = try model.makeState()
    }

    /// Writes one window's cross memory (the encoder's outputs) into row `row`: cross_k / cross_v heads
    /// row*Hkv..<(row+1)*Hkv of every layer, cross_mask row `row`. The row's cache is left as it is.
    func bindRow(_ row: Int, memory: [String: Tensor]) async throws -> Int {
        guard (0..<batch).contains(row) else {
            throw TranscriptionError.invalidArgument("row \(row) is outside the batch of \(batch)")
        }
        var written = 0
        for (name, source) in memoryStates {
            guard let value = memory[source] else {
                throw BundleError.ioMismatch(component: "decoder", function: model.functionName,
                                             detail: "state '\(name)' takes '\(source)', which the encoder does not return")
            }
            guard var shape = model.io.states[name]?.shape, shape.count == 4 else {
                throw BundleError.ioMismatch(component: "decoder", function: model.functionName, detail: "no 4-d state '\(name)'")
            }
            let start: [Int]
            if name == "cross_mask" {
                (shape[0], start) = (1, [row, 0, 0, 0])
            } else {
                (shape[1], start) = (kvHeads, [0, row * kvHeads, 0, 0])
            }
            guard value.shape == shape else {
                throw TranscriptionError.badOutput("the encoder's \(source) is \(value.shape), a row of the batched decoder "
                    + "state \(shape): encoder and decoder of different exports")
            }
            written += try state.write(name, try value.asFloat16(), at: start)
        }
        return written
    }

    func step(tokens: [Int], positions: [Int?]) async throws -> [[Float]] {
        let inputs = try BatchDecoding.inputs(tokens: tokens, positions: positions, batch: batch, capacity: capacity,
                                              cacheMask: cacheMask)
        let out = try await model.predict(inputs, state: state)
        var perRow = 0
        for (name, rowsName) in rowOutputs {
            guard let rows = out[rowsName], rows.shape.count == 4, rows.shape[1] == batch * kvHeads, rows.shape[2] == 1 else {
                throw TranscriptionError.badOutput("the decoder function '\(model.functionName)' returned no (L, \(batch * kvHeads), "
                    + "1, Dh) \(rowsName) rows")
            }
            let half = try rows.asFloat16()
            for (b, position) in positions.enumerated() {
                guard let position else { continue }
                let part = try half.slice(axis: 1, from: b * kvHeads, count: kvHeads)
                try state.write(name, part, at: [0, b * kvHeads, position, 0])
            }
            perRow += half.data.count / batch
        }
        rowBytes = perRow
        guard let scores = out[output], scores.count == batch * vocabSize else {
            throw TranscriptionError.badOutput("the decoder function '\(model.functionName)' returned no (\(batch), \(vocabSize)) \(output)")
        }
        let values = scores.floats()
        return (0..<batch).map { Array(values[($0 * vocabSize)..<(($0 + 1) * vocabSize)]) }
    }
}

extension Tensor {
    /// Entries start..<start + count of axis `axis` (a copy).
    public func slice(axis: Int, from start: Int, count n: Int) throws -> Tensor {
        guard shape.indices.contains(axis), start >= 0, n >= 0, start + n <= shape[axis] else {
            throw TranscriptionError.invalidArray("cannot take \(n) entries from \(start) of axis \(axis) of \(shape)")
        }
        let outer = shape[..<axis].reduce(1, *)
        let inner = shape[(axis + 1)...].reduce(1, *) * dtype.byteSize
        let stride = shape[axis] * inner
        var out = Data(capacity: outer * n * inner)
        data.withUnsafeBytes { raw in
            for o in 0..<outer {
                let from = o * stride + start * inner
                out.append(contentsOf: UnsafeRawBufferPointer(rebasing: raw[from..<(from + n * inner)]))
            }
        }
        var sliced = shape
        sliced[axis] = n
        return try Tensor(dtype: dtype, shape: sliced, data: out)
    }
}
