package com.llmd;

/** How a request went. */
@RustDerive(Clone=true, PartialEq=true)
parcelable GenerationStats {
    int promptTokens;
    int generatedTokens;
    /** Time from the call to the start of its prefill, in milliseconds. */
    long queueWaitMs;
    /** Time from the call to the first generated token, in milliseconds. */
    long timeToFirstTokenMs;
    float prefillTokensPerSecond;
    float decodeTokensPerSecond;
    /** "eos", "length", "stop", "context_full" or "cancelled". */
    @utf8InCpp String finishReason;
}
