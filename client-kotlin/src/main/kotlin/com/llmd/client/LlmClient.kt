package com.llmd.client

import android.os.IBinder
import com.llmd.ChatMessage
import com.llmd.GenerateRequest
import com.llmd.GenerationStats
import com.llmd.IGenerationCallback
import com.llmd.ILlmService
import com.llmd.ILlmSession
import com.llmd.ModelInfo
import com.llmd.SessionOptions
import kotlin.coroutines.resume
import kotlin.coroutines.resumeWithException
import kotlin.coroutines.suspendCoroutine

/**
 * Finds the llmd service. On a device: `ServiceConnector { ServiceManager.getService("llmd") }`
 * for privileged callers, or the binder a system app hands out; in tests, a fake.
 * Returns null while the service is not available.
 */
fun interface ServiceConnector {
    fun connect(): IBinder?
}

/** How [LlmClient] retries reaching the service: exponential backoff, bounded. */
data class ReconnectPolicy(
    val initialDelayMs: Long = 100,
    val maxDelayMs: Long = 5_000,
    val maxAttempts: Int = 8,
    /** How to wait; replaced in tests. */
    val sleeper: (Long) -> Unit = { Thread.sleep(it) },
)

/**
 * A client of the llmd on-device LLM service.
 *
 * Thread-safe. It connects lazily, reconnects with backoff after the service dies, and turns
 * every failure into an [LlmException]. Streaming uses callbacks ([GenerationListener]); for
 * coroutines, [LlmSession.generateText] is a `suspend` function built on the Kotlin standard
 * library (kotlinx-coroutines' Flow is not used: the version available here predates it).
 */
class LlmClient(
    private val connector: ServiceConnector,
    private val policy: ReconnectPolicy = ReconnectPolicy(),
) : AutoCloseable {
    private val lock = Any()
    private var service: ILlmService? = null
    private var binder: IBinder? = null
    private val deathListeners = mutableListOf<() -> Unit>()

    private val recipient = IBinder.DeathRecipient {
        val listeners = synchronized(lock) {
            service = null
            binder = null
            deathListeners.toList()
        }
        listeners.forEach { it() }
    }

    /** The service, connecting (with backoff) if needed. */
    fun service(): ILlmService {
        synchronized(lock) { service?.let { return it } }
        var delay = policy.initialDelayMs
        var last: Throwable? = null
        for (attempt in 1..policy.maxAttempts) {
            try {
                val b = connector.connect()
                if (b != null && b.isBinderAlive) {
                    val s = ILlmService.Stub.asInterface(b)
                    b.linkToDeath(recipient, 0)
                    synchronized(lock) {
                        service = s
                        binder = b
                    }
                    return s
                }
            } catch (t: Throwable) {
                last = t
            }
            if (attempt < policy.maxAttempts) {
                policy.sleeper(delay)
                delay = (delay * 2).coerceAtMost(policy.maxDelayMs)
            }
        }
        throw LlmException.ServiceUnavailable("llmd is not available after ${policy.maxAttempts} attempts", last)
    }

    /**
     * Runs [block] against the service; if the service dies during the call, reconnects (with
     * backoff) and retries once. The calls made this way are all safe to repeat.
     */
    private fun <T> call(block: (ILlmService) -> T): T {
        val s = service()
        try {
            return block(s)
        } catch (t: Throwable) {
            val e = LlmException.from(t)
            if (e !is LlmException.ServiceUnavailable) throw e
            synchronized(lock) { service = null; binder = null }
            try {
                return block(service())
            } catch (t2: Throwable) {
                throw LlmException.from(t2)
            }
        }
    }

    /** Called (on a Binder thread) whenever the service dies. */
    fun addDeathListener(listener: () -> Unit) {
        synchronized(lock) { deathListeners.add(listener) }
    }

    fun listModels(): List<ModelInfo> = call { it.listModels().toList() }

    fun modelInfo(modelId: String): ModelInfo = call { it.getModelInfo(modelId) }

    /** Opens a conversation with [modelId]; [contextTokens] 0 means the model's full context. */
    fun openSession(modelId: String, contextTokens: Int = 0): LlmSession {
        val options = SessionOptions().apply { this.contextTokens = contextTokens }
        val s = call { it.openSession(modelId, options) }
        return LlmSession(s, this)
    }

    internal fun onDeath(listener: () -> Unit) = addDeathListener(listener)

    override fun close() {
        synchronized(lock) {
            binder?.unlinkToDeath(recipient, 0)
            service = null
            binder = null
            deathListeners.clear()
        }
    }
}

/** What to generate: a raw [prompt] or chat [messages] (role to content), and how. */
data class Request(
    val prompt: String = "",
    val messages: List<Pair<String, String>> = emptyList(),
    val maxTokens: Int = 256,
    val temperature: Float = 0f,
    val topK: Int = 40,
    val topP: Float = 0.95f,
    val minP: Float = 0.05f,
    val repetitionPenalty: Float = 1f,
    val seed: Long = 0,
    val stop: List<String> = emptyList(),
) {
    /** The wire form; every field set (the daemon rejects nulls). */
    fun toParcelable(): GenerateRequest = GenerateRequest().also {
        it.prompt = prompt
        it.messages = messages.map { (role, content) -> ChatMessage().apply { this.role = role; this.content = content } }.toTypedArray()
        it.maxTokens = maxTokens
        it.temperature = temperature
        it.topK = topK
        it.topP = topP
        it.minP = minP
        it.repetitionPenalty = repetitionPenalty
        it.seed = seed
        it.stop = stop.toTypedArray()
        it.priority = 0
    }
}

/** Receives one request's output. Exactly one of [onCompleted] or [onError] ends it. */
interface GenerationListener {
    fun onStarted(requestId: Long) {}
    /** [text] is whole characters (may be empty); [tokenIds] the tokens it came from. */
    fun onText(text: String, tokenIds: IntArray)
    fun onCompleted(stats: GenerationStats)
    fun onError(error: LlmException)
}

/** A running request. */
class GenerationHandle internal constructor(val requestId: Long, private val session: ILlmSession) {
    /** Asks the daemon to stop; the listener then gets [LlmException.Cancelled]. */
    fun cancel() {
        try {
            session.cancel(requestId)
        } catch (t: Throwable) {
            throw LlmException.from(t)
        }
    }
}

/** The result of [LlmSession.generateText]. */
data class Completion(val text: String, val stats: GenerationStats)

/** A conversation with one model; the daemon keeps its context between requests. */
class LlmSession internal constructor(private val session: ILlmSession, client: LlmClient) : AutoCloseable {
    private val active = mutableMapOf<Long, Stream>()

    init {
        client.onDeath {
            val streams = synchronized(active) { active.values.toList().also { active.clear() } }
            streams.forEach { it.fail(LlmException.ServiceUnavailable("llmd died during the request")) }
        }
    }

    private inner class Stream(val listener: GenerationListener) : IGenerationCallback.Stub() {
        @Volatile var done = false
        var id = -1L

        fun fail(e: LlmException) {
            if (!done) {
                done = true
                listener.onError(e)
            }
        }

        private fun finish() {
            done = true
            synchronized(active) { active.remove(id) }
        }

        override fun onStarted(requestId: Long) = listener.onStarted(requestId)
        override fun onTokens(requestId: Long, text: String, ids: IntArray) {
            if (!done) listener.onText(text, ids)
        }
        override fun onCompleted(requestId: Long, stats: GenerationStats) {
            if (!done) {
                finish()
                listener.onCompleted(stats)
            }
        }
        override fun onError(requestId: Long, code: Int, message: String) {
            if (!done) {
                finish()
                listener.onError(LlmException.fromCode(code, message))
            }
        }
    }

    /** Starts a request; output streams to [listener]. */
    fun generate(request: Request, listener: GenerationListener): GenerationHandle {
        val stream = Stream(listener)
        val id = try {
            synchronized(active) {
                session.generate(request.toParcelable(), stream).also {
                    stream.id = it
                    if (!stream.done) active[it] = stream
                }
            }
        } catch (t: Throwable) {
            throw LlmException.from(t)
        }
        return GenerationHandle(id, session)
    }

    /** Generates and returns the whole reply; [onText] sees it as it streams. */
    suspend fun generateText(request: Request, onText: (String) -> Unit = {}): Completion = suspendCoroutine { cont ->
        val buffer = StringBuilder()
        val listener = object : GenerationListener {
            override fun onText(text: String, tokenIds: IntArray) {
                buffer.append(text)
                onText(text)
            }
            override fun onCompleted(stats: GenerationStats) = cont.resume(Completion(buffer.toString(), stats))
            override fun onError(error: LlmException) = cont.resumeWithException(error)
        }
        try {
            generate(request, listener)
        } catch (e: LlmException) {
            cont.resumeWithException(e)
        }
    }

    fun countTokens(text: String): Int = wrap { session.countTokens(text) }

    /** Forgets the conversation so far. */
    fun reset() = wrap { session.reset() }

    override fun close() = wrap { session.close() }

    private fun <T> wrap(block: () -> T): T = try {
        block()
    } catch (t: Throwable) {
        throw LlmException.from(t)
    }
}
