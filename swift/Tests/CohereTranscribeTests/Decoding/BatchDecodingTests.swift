@testable import CohereTranscribe
import Foundation
import XCTest

/// Several windows decoded at once (`decoder.batch`, the decoder's `step_batch`; docs/bundle.md, "Decoding several
/// windows at once"): the manifest block and its refusals, the loop of the written rule replayed on a scripted
/// decoder against the shared vectors (tests/data/batch_decoding_vectors.json, the file the Python test replays), and
/// the transcriber's batched clips against one window at a time on the test bundle.
final class BatchDecodingTests: XCTestCase {
    // MARK: - the manifest block

    func manifestObject(_ bundle: URL = Fixtures.bundle) throws -> [String: Any] {
        _ = try Fixtures.require()
        return try JSONSerialization.jsonObject(with: Data(contentsOf: bundle.appendingPathComponent("manifest.json")))
            as! [String: Any]
    }

    /// `edit` applied to the decoder section of `manifest`, then decoded: the field the refusal names (nil: accepted).
    func refusal(_ manifest: [String: Any], _ edit: (inout [String: Any]) -> Void) throws -> String? {
        var m = manifest
        var decoder = m["decoder"] as! [String: Any]
        edit(&decoder)
        m["decoder"] = decoder
        do {
            _ = try BundleManifest.decode(try JSONSerialization.data(withJSONObject: m))
            return nil
        } catch let error as BundleError {
            XCTAssertFalse(error.description.contains("\n"), "one line: \(error)")
            if let field = error.field { XCTAssertTrue(error.description.contains(field), "\(error)") }
            return error.field
        }
    }

    static func set(_ value: Any, at path: [String], in object: inout [String: Any]) {
        guard let key = path.first else { return }
        if path.count == 1 {
            object[key] = value
        } else {
            var inner = object[key] as! [String: Any]
            set(value, at: Array(path.dropFirst()), in: &inner)
            object[key] = inner
        }
    }

    func testTheBatchBlockIsReadAndABrokenOneIsRefusedNamingTheField() throws {
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        let batch = try XCTUnwrap(m.decoder.batch, "the test bundle's decoder has its batched step (the default export)")
        XCTAssertGreaterThan(batch.size, 1)
        XCTAssertEqual(m.decoder.functions?.stepBatch, "step_batch")
        let listed = try XCTUnwrap(m.listedIO(component: "decoder", function: "step_batch"))
        XCTAssertEqual(listed, m.expectedBatchDecoderIO())  // what the transcriber checks the loaded function against
        XCTAssertEqual(listed.states["cross_k"]?.shape[1], batch.size * m.decoder.cacheShape[1])
        XCTAssertEqual(listed.states["cross_mask"]?.shape[0], batch.size)

        let json = try manifestObject()
        let b = batch.size, kv = m.decoder.cacheShape[1]
        XCTAssertNil(try refusal(json) { _ in })
        let cases: [(String, (inout [String: Any]) -> Void)] = [
            ("decoder.batch.size", { Self.set(b + 1, at: ["batch", "size"], in: &$0) }),
            ("decoder.batch.size", { Self.set(1, at: ["batch", "size"], in: &$0) }),
            ("decoder.batch.size", { Self.set("4", at: ["batch", "size"], in: &$0) }),
            ("decoder.batch", { $0["batch"] = nil }),  // step_batch named, no block
            ("decoder.batch", { Self.set(NSNull(), at: ["functions", "step_batch"], in: &$0) }),  // a block, no function
            ("decoder.batch", { $0["batch"] = [1, 2] }),
            ("decoder.functions.step_batch", { Self.set(5, at: ["functions", "step_batch"], in: &$0) }),
            ("decoder.batch.io", { Self.set(NSNull(), at: ["batch", "io"], in: &$0) }),
            ("decoder.batch.io.inputs", { Self.set(["shape": [b], "dtype": "int32"], at: ["batch", "io", "inputs", "encoder_length"], in: &$0) }),
            ("decoder.batch.io.inputs.position.shape", { Self.set([1], at: ["batch", "io", "inputs", "position", "shape"], in: &$0) }),
            ("decoder.batch.io.states.cross_mask.shape",  // a row's mask, not B rows
             { Self.set([1, 1, 1, m.encoder.memoryLength], at: ["batch", "io", "states", "cross_mask", "shape"], in: &$0) }),
            ("decoder.batch.io.outputs.new_k.shape",  // Hkv heads, not B * Hkv
             { Self.set([m.decoder.cacheShape[0], kv, 1, m.decoder.cacheShape[3]], at: ["batch", "io", "outputs", "new_k", "shape"], in: &$0) }),
            ("decoder.batch.io.states.self_v.dtype", { Self.set("float32", at: ["batch", "io", "states", "self_v", "dtype"], in: &$0) }),
        ]
        for (field, edit) in cases {
            XCTAssertEqual(try refusal(json, edit), field)
        }
        // the graph-state decoder has no batched step: a block there is refused; without one it reads as batch 1
        let graph = try manifestObject(Fixtures.graphBundle)
        XCTAssertNil(try BundleManifest.load(bundle: Fixtures.graphBundle).decoder.batch)
        XCTAssertEqual(try refusal(graph) {
            $0["batch"] = (json["decoder"] as! [String: Any])["batch"]
            Self.set("step_batch", at: ["functions", "step_batch"], in: &$0)
        }, "decoder.batch")
    }

    func testDecoderBatchOtherThanTheBundlesIsRefusedInOneLine() throws {
        let m = try BundleManifest.load(bundle: Fixtures.bundle)
        let b = try XCTUnwrap(m.decoder.batch?.size)
        XCTAssertEqual(try CohereTranscriber.checkedBatch(nil, manifest: m), b)
        XCTAssertEqual(try CohereTranscriber.checkedBatch(1, manifest: m), 1)
        XCTAssertEqual(try CohereTranscriber.checkedBatch(b, manifest: m), b)
        XCTAssertThrowsError(try CohereTranscriber.checkedBatch(b + 1, manifest: m)) {
            XCTAssertTrue("\($0)".contains("decodes \(b) windows at once (decoder.batch.size); use decoderBatch \(b) or 1"), "\($0)")
        }
        XCTAssertThrowsError(try CohereTranscriber.checkedBatch(0, manifest: m))
        let g = try BundleManifest.load(bundle: Fixtures.graphBundle)
        XCTAssertEqual(try CohereTranscriber.checkedBatch(nil, manifest: g), 1)
        XCTAssertThrowsError(try CohereTranscriber.checkedBatch(2, manifest: g)) {
            XCTAssertTrue("\($0)".contains("export --decoder-batch 2"), "\($0)")
        }
        // the command line: one line on stderr, exit status 2, before any model loads
        #if os(macOS) || os(Linux)
        let cli = try Fixtures.swiftCLI()
        let wav = try Fixtures.require().appendingPathComponent("wav/en_heldout_00002.wav").path
        for (arguments, message) in [(["--decoder-batch", "\(b + 1)"], "--decoder-batch \(b + 1): the bundle's decoder decodes \(b) "
                                       + "windows at once (decoder.batch.size); use --decoder-batch \(b) or 1"),
                                      (["--decoder-batch", "0"], "--decoder-batch needs a positive integer")] {
            let process = Process()
            process.executableURL = cli
            process.arguments = ["--bundle", Fixtures.bundle.path, "--language", "en", "--runtime", "interpreter",
                                 "--interpreter", "/nonexistent/cohere-coreml"] + arguments + [wav]
            let err = Pipe()
            process.standardError = err
            process.standardOutput = Pipe()
            try process.run()
            let stderr = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            process.waitUntilExit()
            XCTAssertEqual(process.terminationStatus, 2, "\(arguments)")
            XCTAssertEqual(stderr, "cohere-transcribe-swift: error: \(message)\n", "\(arguments)")
        }
        #endif
    }

    // MARK: - the rule, on a scripted decoder

    /// Window w (its memory: w) predicts token 100 + k at its k-th prediction after its prompt and eos once k reaches
    /// `lengths[w]`; every call's rows are recorded as [window, token fed, position] (nil: a free row). The Python
    /// test's `Scripted`.
    final class Scripted: BatchStepDecoder {
        let batch: Int, capacity: Int, lengths: [Int], eos: Int, promptLength: Int
        var window: [Int: Int] = [:]
        var calls: [[[Int]?]] = []
        var freeRowTokens: Set<Int> = []

        init(batch: Int, capacity: Int, lengths: [Int], eos: Int, promptLength: Int) {
            (self.batch, self.capacity, self.lengths, self.eos, self.promptLength) = (batch, capacity, lengths, eos, promptLength)
        }

        func bindRow(_ row: Int, memory: Int) async throws -> Int {
            window[row] = memory
            return 0
        }

        func step(tokens: [Int], positions: [Int?]) async throws -> [[Float]] {
            var rows: [[Int]?] = []
            var out = [[Float]](repeating: [Float](repeating: 0, count: 200), count: batch)
            for b in 0..<batch {
                guard let p = positions[b] else {
                    freeRowTokens.insert(tokens[b])
                    rows.append(nil)
                    continue
                }
                let w = window[b]!
                rows.append([w, tokens[b], p])
                let k = p - (promptLength - 1)  // predictions after the prompt's last token: 0, 1, ...
                out[b][k >= lengths[w] ? eos : 100 + max(k, 0)] = 1
            }
            calls.append(rows)
            return out
        }
    }

    /// A broken host around the scripted decoder: a refilled row keeps the memory of its first window
    /// (`staleMemory`), or continues at the slots after its previous window's instead of slot 0 (`stalePosition`).
    final class BrokenHost: BatchStepDecoder {
        enum Fault { case staleMemory, stalePosition }
        let inner: Scripted, fault: Fault
        var bound: Set<Int> = [], offset: [Int: Int] = [:], last: [Int: Int] = [:]
        var batch: Int { inner.batch }
        var capacity: Int { inner.capacity }

        init(_ inner: Scripted, _ fault: Fault) { (self.inner, self.fault) = (inner, fault) }

        func bindRow(_ row: Int, memory: Int) async throws -> Int {
            defer { bound.insert(row) }
            if bound.contains(row) {
                if fault == .staleMemory { return 0 }
                offset[row] = (last[row] ?? 0) + 1
            }
            return try await inner.bindRow(row, memory: memory)
        }

        func step(tokens: [Int], positions: [Int?]) async throws -> [[Float]] {
            for (b, p) in positions.enumerated() { if let p { last[b] = p + (offset[b] ?? 0) } }
            return try await inner.step(tokens: tokens, positions: positions.enumerated().map { b, p in p.map { $0 + (offset[b] ?? 0) } })
        }
    }

    struct VectorCase {
        var name: String, batch: Int, capacity: Int, generated: [Int], maxNewTokens: Int?
        var calls: [[[Int]?]]
        var finished: [(window: Int, tokens: [Int], reason: String)]
    }

    /// tests/data/batch_decoding_vectors.json, the file the Python test reads (not a copy).
    func vectors() throws -> (prompt: [Int], eos: Int, cases: [VectorCase]) {
        let url = Fixtures.repoRoot.appendingPathComponent("tests/data/batch_decoding_vectors.json")
        let data = try JSONSerialization.jsonObject(with: Data(contentsOf: url)) as! [String: Any]
        XCTAssertEqual(data["format"] as? String, "cohere-coreml-batch-decoding-vectors")
        let cases = (data["cases"] as! [[String: Any]]).map { c in
            VectorCase(name: c["name"] as! String, batch: c["batch"] as! Int, capacity: c["capacity"] as! Int,
                       generated: c["generated"] as! [Int], maxNewTokens: c["max_new_tokens"] as? Int,
                       calls: (c["calls"] as! [[Any]]).map { $0.map { $0 as? [Int] } },
                       finished: (c["finished"] as! [[Any]]).map { ($0[0] as! Int, $0[1] as! [Int], $0[2] as! String) })
        }
        return (data["prompt"] as! [Int], data["eos"] as! Int, cases)
    }

    /// The loop on `decoder` over the case's windows: the windows in the order they finished.
    func run<D: BatchStepDecoder>(_ decoder: D, _ c: VectorCase, prompt: [Int], eos: Int) async throws
        -> [(window: Int, tokens: [Int], reason: String)] where D.Memory == Int {
        var waiting = c.generated.indices.makeIterator()
        var finished: [(Int, [Int], String)] = []
        try await BatchDecoding.decodeWindows(decoder, prompt: prompt, eosIds: [eos], maxNewTokens: c.maxNewTokens, next: {
            waiting.next().map { (key: $0, memory: $0) }
        }, finished: { key, decoded in
            XCTAssertEqual(decoded.tokenLogProbs.count, decoded.tokens.count)
            finished.append((key, decoded.tokens, decoded.stopReason.rawValue))
        })
        return finished
    }

    /// Which window each row holds at each call, the token it feeds and its position, and the order windows finish
    /// in (with their tokens and stop reasons): the shared vectors' schedule.
    func testTheScheduleFollowsTheWrittenRule() async throws {
        let (prompt, eos, cases) = try vectors()
        XCTAssertGreaterThanOrEqual(cases.count, 3)
        XCTAssertTrue(cases.contains { $0.generated.count > $0.batch }, "a case refills rows")
        for c in cases {
            let fake = Scripted(batch: c.batch, capacity: c.capacity, lengths: c.generated, eos: eos, promptLength: prompt.count)
            let finished = try await run(fake, c, prompt: prompt, eos: eos)
            XCTAssertEqual(fake.calls, c.calls, c.name)
            XCTAssertEqual(finished.map(\.window), c.finished.map(\.window), c.name)
            XCTAssertEqual(finished.map(\.tokens), c.finished.map(\.tokens), c.name)
            XCTAssertEqual(finished.map(\.reason), c.finished.map(\.reason), c.name)
            XCTAssertTrue(fake.freeRowTokens.isSubset(of: [BatchDecoding.padToken]), c.name)
        }
    }

    /// The vectors see a host that forgets to rewrite a refilled row's memory or to start it at slot 0.
    func testAHostThatBreaksTheRuleIsCaught() async throws {
        let (prompt, eos, cases) = try vectors()
        let c = try XCTUnwrap(cases.first { $0.generated.count > $0.batch })
        for fault in [BrokenHost.Fault.staleMemory, .stalePosition] {
            let fake = Scripted(batch: c.batch, capacity: c.capacity, lengths: c.generated, eos: eos, promptLength: prompt.count)
            let finished = try await run(BrokenHost(fake, fault), c, prompt: prompt, eos: eos)
            XCTAssertNotEqual(fake.calls, c.calls, "\(fault)")
            XCTAssertFalse(finished.map(\.tokens) == c.finished.map(\.tokens) && fake.calls == c.calls, "\(fault)")
        }
    }

    /// A call's inputs: each busy row's token and slot, its mask open below its slot; a free row pad id, slot 0, closed.
    func testACallsInputsOpenEachRowsOwnSlots() throws {
        let inputs = try BatchDecoding.inputs(tokens: [7, 9, 11], positions: [2, nil, 0], batch: 3, capacity: 4)
        XCTAssertEqual(inputs["input_ids"]?.int32s(), [7, 0, 11])
        XCTAssertEqual(inputs["input_ids"]?.shape, [3, 1])
        XCTAssertEqual(inputs["position"]?.int32s(), [2, 0, 0])
        let mask = try XCTUnwrap(inputs["cache_mask"])
        XCTAssertEqual(mask.shape, [3, 1, 1, 4])
        XCTAssertEqual(mask.floats().map { $0 == 0 }, [true, true, false, false, false, false, false, false, false, false, false, false])
        XCTAssertTrue(mask.floats().allSatisfy { $0 == 0 || $0 < -9000 })
        XCTAssertThrowsError(try BatchDecoding.inputs(tokens: [1], positions: [4], batch: 1, capacity: 4))
        XCTAssertThrowsError(try BatchDecoding.inputs(tokens: [1, 2], positions: [0], batch: 2, capacity: 4))
        // a row of the new K/V rows: heads b*Hkv..<(b+1)*Hkv of every layer
        let rows = try Tensor(int32: (0..<24).map(Int32.init), shape: [2, 6, 1, 2])
        XCTAssertEqual(try rows.slice(axis: 1, from: 2, count: 2).int32s(), [4, 5, 6, 7, 16, 17, 18, 19])
    }

    // MARK: - the transcriber, end to end

    /// Held-out utterances one after the other with pauses of quiet noise longer than the VAD's window gap: one
    /// speech window each, of different lengths (and token counts), more windows than the batch's rows.
    func severalWindows(_ count: Int) throws -> [Float] {
        let audio = try Fixtures.json("audio.json") as! [String: Any]
        let clips = (audio["clips"] as! [[String: Any]]).filter { ($0["group"] as? String) == "heldout" }
        var rng = SplitMix64(seed: 7)
        var samples: [Float] = []
        for clip in clips.prefix(count) {
            samples += try AudioInput.load(contentsOf: URL(fileURLWithPath: clip["wav"] as! String), sampleRate: 16000).samples
            samples += (0..<40000).map { _ in Float(Double(rng.next() % 2001) / 1000 - 1) * 2e-3 }  // 2.5 s
        }
        return samples
    }

    /// The clip's windows through `step_batch` (the bundle's B rows, refilled) are token-identical to one window at a
    /// time, with the token limit too; each batched window's state writes are its memory once and one K/V row per fed
    /// token; the next window's encoder runs while the rows decode. Word timings decode one window at a time. A state
    /// that keeps a refilled row's previous memory (a host that does not rewrite it) gives other tokens. On the
    /// interpreter: the Core ML runtime's batched path (`functionName`, `withMultiArray(for:)` over the emulation) is
    /// TranscriberTests' (a file of several windows, both runtimes, against the Python CLI) and the CLI test's.
    func testBatchedWindowsAreTokenIdenticalToOneAtATime() async throws {
        let samples = try severalWindows(6)
        for (runtimeName, runtime) in [("interpreter", try Fixtures.interpreter() as ModelRuntime)] {
            let probe = StageProbe(runtime)
            let batched = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: probe)
            let one = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: runtime, decoderBatch: 1)
            let b = batched.decoderBatch
            XCTAssertGreaterThan(b, 1, "the test bundle's batched step")
            let m = batched.manifest
            let prompt = try m.prompt(language: "en")
            let c = m.decoder.cacheShape, mem = m.decoder.memoryShape
            let rowBytes = 2 * c[0] * c[1] * c[3] * 2, memoryBytes = 2 * mem.reduce(1, *) * 2 + m.encoder.memoryLength * 2
            var unlimited: TranscriptionResult?
            for maxNewTokens in [nil, 3] as [Int?] {
                let name = "\(runtimeName), maxNewTokens \(maxNewTokens.map(String.init) ?? "nil")"
                let want = try await one.transcribe(samples: samples, language: "en", maxNewTokens: maxNewTokens, vad: .on)
                let got = try await batched.transcribe(samples: samples, language: "en", maxNewTokens: maxNewTokens, vad: .on)
                XCTAssertGreaterThan(want.windows.count, b + 1, "\(name): rows are refilled")
                XCTAssertEqual(got.tokenIds, want.tokenIds, name)
                XCTAssertEqual(got.windows.map(\.stopReason), want.windows.map(\.stopReason), name)
                XCTAssertEqual(got.windows.map(\.index), Array(want.windows.indices), name)
                XCTAssertEqual(got.windows.map(\.startSeconds), want.windows.map(\.startSeconds), name)
                XCTAssertEqual(got.windows.map(\.durationSeconds), want.windows.map(\.durationSeconds), name)
                XCTAssertEqual(got.windows.map(\.timings.encoderFunction), want.windows.map(\.timings.encoderFunction), name)
                XCTAssertEqual(got.text, want.text, name)
                XCTAssertTrue(got.windows.allSatisfy { $0.timings.decoderBatch == b }, name)
                XCTAssertTrue(want.windows.allSatisfy { $0.timings.decoderBatch == 1 }, name)
                for w in got.windows {  // one token a call: the prompt, then every token but the last
                    XCTAssertEqual(w.timings.decoderCalls, prompt.count + w.tokenIds.count - 1, name)
                    XCTAssertEqual(w.timings.decoderStateBytesWritten, memoryBytes + rowBytes * w.timings.decoderCalls, name)
                }
                if maxNewTokens == nil {
                    // two stages: the next window's encoder ran while rows decoded (its memory ready before a row
                    // freed up), never more than one memory outside the rows (B + 1 held)
                    let ahead = probe.aheadAtEachCall()
                    XCTAssertGreaterThanOrEqual(ahead.count, got.windows.map(\.timings.decoderCalls).max() ?? 1, name)
                    XCTAssertTrue(ahead.allSatisfy { (0...1).contains($0) }, "\(name): \(ahead)")
                    XCTAssertTrue(ahead.contains(1), "\(name): no window was encoded while the rows decoded")
                    XCTAssertEqual(probe.encoded, want.windows.count, name)
                    unlimited = want
                    XCTAssertGreaterThan(Set(want.tokenIds.map(\.count)).count, 1, "\(name): windows of several lengths")
                    XCTAssertTrue(want.windows.contains { $0.stopReason == .eos }, name)
                } else {
                    XCTAssertTrue(want.windows.contains { $0.stopReason == .maxNewTokens }, name)
                }
            }
            guard let want = unlimited else { continue }
            // word timings decode one window at a time (the batch-1 loop)
            if m.decoder.alignment != nil {
                let words = try await batched.transcribe(samples: try severalWindows(2), language: "en", maxNewTokens: 1,
                                                         wordTimestamps: true, vad: .on)
                XCTAssertEqual(words.windows.count, 2)
                XCTAssertTrue(words.windows.allSatisfy { $0.timings.decoderBatch == 1 }, runtimeName)
            }
            do {
                let stale = try await CohereTranscriber(bundle: Fixtures.bundle, runtime: StaleMemoryRuntime(runtime))
                let wrong = try await stale.transcribe(samples: samples, language: "en", vad: .on)
                XCTAssertEqual(Array(wrong.tokenIds.prefix(b)), Array(want.tokenIds.prefix(b)), "the first B windows have their own rows")
                XCTAssertNotEqual(wrong.tokenIds, want.tokenIds, "a refilled row decoding its previous window's memory")
            }
        }
    }
}

/// A runtime whose `step_batch` states keep the first memory written into each row: a host that does not rewrite
/// a refilled row's memory (every other write and function as the wrapped runtime's).
final class StaleMemoryRuntime: ModelRuntime, @unchecked Sendable {
    let inner: ModelRuntime
    var name: String { inner.name }
    init(_ inner: ModelRuntime) { self.inner = inner }

    func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        let model = try await inner.loadModel(at: package, functionName: functionName, computeUnits: computeUnits)
        return functionName == "step_batch" ? Model(model) : model
    }

    final class Model: RuntimeModel, @unchecked Sendable {
        let inner: RuntimeModel
        var functionName: String { inner.functionName }
        var io: ModelIO { inner.io }
        init(_ inner: RuntimeModel) { self.inner = inner }
        func makeState() throws -> RuntimeState { State(try inner.makeState()) }
        func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
            try await inner.predict(inputs, state: (state as? State)?.inner ?? state)
        }
    }

    final class State: RuntimeState {
        let inner: RuntimeState
        var written: Set<String> = []
        init(_ inner: RuntimeState) { self.inner = inner }
        func write(_ name: String, _ value: Tensor, at start: [Int]) throws -> Int {
            if name.hasPrefix("cross_") {
                let key = "\(name)@\(start)"
                if written.contains(key) { return value.data.count }  // the row's first memory stays
                written.insert(key)
            }
            return try inner.write(name, value, at: start)
        }
    }
}

/// A runtime that watches a batched clip's two stages: the encoder's outputs made (`encoded`), the windows whose memory
/// went into a row of the `step_batch` state (`entered`), and at each batched call how many memories were made but not
/// yet in a row (at most one: B + 1 held).
final class StageProbe: ModelRuntime, @unchecked Sendable {
    let inner: ModelRuntime
    var name: String { inner.name }
    private let lock = NSLock()
    private var made = 0, inRows = 0, ahead: [Int] = []
    init(_ inner: ModelRuntime) { self.inner = inner }

    var encoded: Int { lock.withLock { made } }
    func aheadAtEachCall() -> [Int] { lock.withLock { ahead } }

    func loadModel(at package: URL, functionName: String?, computeUnits: ComputeUnits) async throws -> RuntimeModel {
        let model = try await inner.loadModel(at: package, functionName: functionName, computeUnits: computeUnits)
        if package.lastPathComponent == "encoder.mlpackage" { return Model(model, probe: self, kind: .encoder) }
        return functionName == "step_batch" ? Model(model, probe: self, kind: .step) : model
    }

    final class Model: RuntimeModel, @unchecked Sendable {
        enum Kind { case encoder, step }
        let inner: RuntimeModel, probe: StageProbe, kind: Kind
        var functionName: String { inner.functionName }
        var io: ModelIO { inner.io }
        init(_ inner: RuntimeModel, probe: StageProbe, kind: Kind) { (self.inner, self.probe, self.kind) = (inner, probe, kind) }
        func makeState() throws -> RuntimeState { State(try inner.makeState(), probe: probe) }
        func predict(_ inputs: [String: Tensor], state: RuntimeState?) async throws -> [String: Tensor] {
            if kind == .step { probe.lock.withLock { probe.ahead.append(probe.made - probe.inRows) } }
            let out = try await inner.predict(inputs, state: (state as? State)?.inner ?? state)
            if kind == .encoder { probe.lock.withLock { probe.made += 1 } }
            return out
        }
    }

    final class State: RuntimeState {
        let inner: RuntimeState, probe: StageProbe
        init(_ inner: RuntimeState, probe: StageProbe) { (self.inner, self.probe) = (inner, probe) }
        func write(_ name: String, _ value: Tensor, at start: [Int]) throws -> Int {
            if name == "cross_k" { probe.lock.withLock { probe.inRows += 1 } }
            return try inner.write(name, value, at: start)
        }
    }
}
