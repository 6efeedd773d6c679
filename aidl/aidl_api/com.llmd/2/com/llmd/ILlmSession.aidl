package com.llmd;

import com.llmd.GenerateRequest;
import com.llmd.IGenerationCallback;

/**
 * A conversation with one model. It keeps its context (KV cache) across requests until reset()
 * or close(); it belongs to the caller that opened it and is freed when that caller dies.
 */
interface ILlmSession {
    /** Queues a request; output streams to `callback`. Returns the request id. */
    long generate(in GenerateRequest request, IGenerationCallback callback);
    /** Stops a running or queued request; its turn is dropped from the context. */
    void cancel(long requestId);
    /** Tokens `text` would take with this session's model. */
    int countTokens(@utf8InCpp String text);
    /** Forgets the conversation so far. */
    void reset();
    /** Frees the session; later calls fail with SESSION_CLOSED. */
    void close();
}
