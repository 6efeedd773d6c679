package com.llmd.client

import android.os.Binder
import android.os.DeadObjectException
import android.os.IBinder
import android.os.IInterface
import android.os.Parcel
import android.os.ServiceSpecificException
import com.llmd.GenerateRequest
import com.llmd.GenerationStats
import com.llmd.IGenerationCallback
import com.llmd.ILlmService
import com.llmd.ILlmSession
import com.llmd.ModelInfo
import com.llmd.ServiceStatus
import com.llmd.SessionOptions
import java.util.concurrent.CopyOnWriteArrayList
import java.util.concurrent.CountDownLatch
import java.util.concurrent.TimeUnit
import java.util.concurrent.atomic.AtomicBoolean
import kotlin.coroutines.Continuation
import kotlin.coroutines.EmptyCoroutineContext
import kotlin.coroutines.startCoroutine

// JVM tests of the client against a fake llmd that speaks the same AIDL through real
// (host stand-in) Parcels. Run by client-kotlin/build.sh; prints "N passed, M failed".

/** A binder in "another process": transact goes through Parcels, death is observable. */
class RemoteBinder(private val local: Binder) : IBinder {
    private val dead = AtomicBoolean(false)
    private val recipients = CopyOnWriteArrayList<IBinder.DeathRecipient>()
    fun kill() {
        if (dead.compareAndSet(false, true)) recipients.forEach { it.binderDied() }
    }
    val isDead get() = dead.get()
    override fun getInterfaceDescriptor(): String = local.interfaceDescriptor
    override fun pingBinder() = !dead.get()
    override fun isBinderAlive() = !dead.get()
    override fun queryLocalInterface(descriptor: String): IInterface? = null
    override fun transact(code: Int, data: Parcel, reply: Parcel?, flags: Int): Boolean {
        if (dead.get()) throw DeadObjectException("the service died")
        return local.transact(code, data, reply, flags)
    }
    override fun linkToDeath(recipient: IBinder.DeathRecipient, flags: Int) {
        if (dead.get()) throw DeadObjectException("already dead")
        recipients.add(recipient)
    }
    override fun unlinkToDeath(recipient: IBinder.DeathRecipient, flags: Int) = recipients.remove(recipient)
}

class FakeSession(private val owner: FakeService) : ILlmSession.Stub() {
    val remote = RemoteBinder(this)
    private var nextId = 1L
    val cancelCalls = CopyOnWriteArrayList<Long>()
    override fun asBinder(): IBinder = remote

    override fun generate(request: GenerateRequest, callback: IGenerationCallback): Long {
        if (request.prompt.isEmpty() && request.messages.isEmpty()) throw ServiceSpecificException(1, "the prompt is empty")
        if (request.maxTokens > 100) throw ServiceSpecificException(5, "maxTokens ${request.maxTokens} exceeds the limit of 100")
        val id = nextId++
        val words = listOf("Hello", ",", " world", "!")
        Thread {
            callback.onStarted(id)
            var n = 0
            while (n < request.maxTokens) {
                if (owner.dead.get()) return@Thread
                if (id in cancelCalls) {
                    callback.onError(id, 7, "request cancelled")
                    return@Thread
                }
                val slow = request.prompt == "slow"
                callback.onTokens(id, if (slow) "." else words[n % words.size], intArrayOf(n))
                n++
                if (!slow && n == words.size) break
                Thread.sleep(if (slow) 10 else 2)
            }
            callback.onCompleted(id, GenerationStats().apply { promptTokens = 3; generatedTokens = n; finishReason = "eos" })
        }.start()
        return id
    }
    override fun cancel(requestId: Long) { cancelCalls.add(requestId) }
    override fun countTokens(text: String): Int = text.split(" ").size
    override fun reset() {}
    override fun close() {}
}

class FakeService : ILlmService.Stub() {
    val dead = AtomicBoolean(false)
    val remote = RemoteBinder(this)
    val sessions = CopyOnWriteArrayList<FakeSession>()
    override fun asBinder(): IBinder = remote
    fun kill() { dead.set(true); remote.kill(); sessions.forEach { it.remote.kill() } }
    override fun listModels(): Array<ModelInfo> = arrayOf(ModelInfo().apply { id = "tiny"; architecture = "llama"; layers = 2 })
    override fun getModelInfo(modelId: String): ModelInfo =
        listModels().firstOrNull { it.id == modelId } ?: throw ServiceSpecificException(2, "model \"$modelId\" is not installed")
    override fun openSession(modelId: String, options: SessionOptions): ILlmSession {
        getModelInfo(modelId)
        if (options.contextTokens < 0) throw ServiceSpecificException(1, "contextTokens must not be negative")
        return FakeSession(this).also { sessions.add(it) }
    }
    override fun getStatus(): ServiceStatus = ServiceStatus().apply { interfaceVersion = ILlmService.VERSION }
}

/** Hands out services in order; `nulls` times null first (the service restarting). */
class FakeConnector(vararg services: FakeService) : ServiceConnector {
    private val queue = ArrayDeque(services.toList())
    var current: FakeService? = null
    var nullsBeforeNext = 0
    var attempts = 0
    override fun connect(): IBinder? {
        attempts++
        if (current != null && !current!!.dead.get()) return current!!.remote
        if (nullsBeforeNext > 0) { nullsBeforeNext--; return null }
        current = queue.removeFirstOrNull() ?: return null
        return current!!.remote
    }
}

class Collector : GenerationListener {
    val text = StringBuilder()
    val done = CountDownLatch(1)
    var stats: GenerationStats? = null
    var error: LlmException? = null
    var started = -1L
    override fun onStarted(requestId: Long) { started = requestId }
    override fun onText(text: String, tokenIds: IntArray) { synchronized(this) { this.text.append(text) } }
    override fun onCompleted(stats: GenerationStats) { this.stats = stats; done.countDown() }
    override fun onError(error: LlmException) { this.error = error; done.countDown() }
    fun await() = check(done.await(5, TimeUnit.SECONDS)) { "the request did not end" }
}

fun <T> runSuspend(block: suspend () -> T): T {
    val latch = CountDownLatch(1)
    var result: Result<T>? = null
    block.startCoroutine(Continuation(EmptyCoroutineContext) { result = it; latch.countDown() })
    check(latch.await(5, TimeUnit.SECONDS)) { "the coroutine did not finish" }
    return result!!.getOrThrow()
}

fun expect(cond: Boolean, what: () -> String) { if (!cond) throw AssertionError(what()) }

inline fun <reified E : LlmException> expectThrows(block: () -> Unit) {
    try {
        block()
    } catch (e: LlmException) {
        expect(e is E) { "expected ${E::class.simpleName}, got ${e::class.simpleName}: ${e.message}" }
        return
    }
    throw AssertionError("expected ${E::class.simpleName}, nothing was thrown")
}

val tests: List<Pair<String, () -> Unit>> = listOf(
    "lists models through a proxy" to {
        val client = LlmClient(FakeConnector(FakeService()))
        val models = client.listModels()
        expect(models.map { it.id } == listOf("tiny")) { "models $models" }
    },
    "streams tokens in order and completes" to {
        val client = LlmClient(FakeConnector(FakeService()))
        val session = client.openSession("tiny")
        val c = Collector()
        val handle = session.generate(Request(prompt = "hi", maxTokens = 10), c)
        c.await()
        expect(c.error == null) { "error ${c.error}" }
        expect(c.text.toString() == "Hello, world!") { "text '${c.text}'" }
        expect(c.stats?.finishReason == "eos" && c.stats?.generatedTokens == 4) { "stats ${c.stats?.finishReason}" }
        expect(c.started == handle.requestId) { "started ${c.started} vs ${handle.requestId}" }
    },
    "a suspend call returns the whole reply" to {
        val client = LlmClient(FakeConnector(FakeService()))
        val session = client.openSession("tiny")
        val seen = StringBuilder()
        val completion = runSuspend { session.generateText(Request(messages = listOf("user" to "hi"), maxTokens = 10)) { seen.append(it) } }
        expect(completion.text == "Hello, world!" && seen.toString() == completion.text) { "completion '${completion.text}'" }
    },
    "cancel reaches ILlmSession.cancel and ends the stream" to {
        val svc = FakeService()
        val client = LlmClient(FakeConnector(svc))
        val session = client.openSession("tiny")
        val c = Collector()
        val handle = session.generate(Request(prompt = "slow", maxTokens = 100), c)
        Thread.sleep(50)
        handle.cancel()
        c.await()
        expect(svc.sessions.single().cancelCalls == listOf(handle.requestId)) { "cancel calls ${svc.sessions.single().cancelCalls}" }
        expect(c.error is LlmException.Cancelled) { "error ${c.error}" }
    },
    "errors map to typed exceptions" to {
        val client = LlmClient(FakeConnector(FakeService()))
        expectThrows<LlmException.ModelNotFound> { client.openSession("missing") }
        expectThrows<LlmException.InvalidArgument> { client.openSession("tiny", contextTokens = -1) }
        val session = client.openSession("tiny")
        expectThrows<LlmException.InvalidArgument> { session.generate(Request(prompt = ""), Collector()) }
        expectThrows<LlmException.RequestTooLarge> { session.generate(Request(prompt = "x", maxTokens = 1000), Collector()) }
        val expected = mapOf(1 to "InvalidArgument", 2 to "ModelNotFound", 3 to "PermissionDenied", 4 to "QuotaExceeded",
            5 to "RequestTooLarge", 6 to "Busy", 7 to "Cancelled", 8 to "SessionClosed", 9 to "ModelLoadFailed", 10 to "Internal")
        for ((code, name) in expected) {
            val e = LlmException.fromCode(code, "m")
            expect(e::class.simpleName == name && e.code == code) { "code $code gave ${e::class.simpleName}" }
        }
        expect(LlmException.from(DeadObjectException()) is LlmException.ServiceUnavailable) { "dead object" }
    },
    "service death fails the running request and the client reconnects with backoff" to {
        val first = FakeService()
        val second = FakeService()
        val connector = FakeConnector(first, second)
        val delays = mutableListOf<Long>()
        val client = LlmClient(connector, ReconnectPolicy(initialDelayMs = 100, maxDelayMs = 1000, maxAttempts = 5, sleeper = { delays.add(it) }))
        var died = 0
        client.addDeathListener { died++ }
        val session = client.openSession("tiny")
        val c = Collector()
        session.generate(Request(prompt = "slow", maxTokens = 100), c)
        Thread.sleep(30)
        connector.nullsBeforeNext = 2
        first.kill()
        c.await()
        expect(c.error is LlmException.ServiceUnavailable) { "error ${c.error}" }
        expect(died == 1) { "death listeners called $died times" }
        expectThrows<LlmException.ServiceUnavailable> { session.countTokens("a b") }
        val models = client.listModels()
        expect(models.single().id == "tiny") { "after reconnect $models" }
        expect(delays == listOf(100L, 200L)) { "backoff delays $delays" }
        expect(connector.current === second) { "not the new service" }
        val again = Collector()
        client.openSession("tiny").generate(Request(prompt = "hi", maxTokens = 10), again)
        again.await()
        expect(again.text.toString() == "Hello, world!") { "after reconnect '${again.text}'" }
    },
    "gives up after the configured attempts" to {
        val connector = FakeConnector()
        val delays = mutableListOf<Long>()
        val client = LlmClient(connector, ReconnectPolicy(initialDelayMs = 100, maxDelayMs = 300, maxAttempts = 4, sleeper = { delays.add(it) }))
        expectThrows<LlmException.ServiceUnavailable> { client.listModels() }
        expect(delays == listOf(100L, 200L, 300L)) { "delays $delays" }
        expect(connector.attempts == 4) { "attempts ${connector.attempts}" }
    },
)

fun main() {
    var passed = 0
    var failed = 0
    for ((name, test) in tests) {
        try {
            test()
            println("ok   $name")
            passed++
        } catch (t: Throwable) {
            println("FAIL $name: $t")
            failed++
        }
    }
    println("$passed passed, $failed failed")
    System.out.flush()
    kotlin.system.exitProcess(if (failed == 0) 0 else 1)
}
