package com.llmd;

import com.llmd.GenerationStats;

/** Streams one request's output back to its caller. Exactly one of onCompleted / onError ends it. */
oneway interface IGenerationCallback {
    void onStarted(long requestId);
    /** `text` is whole UTF-8 characters (possibly empty); `ids` are the tokens it came from. */
    void onTokens(long requestId, @utf8InCpp String text, in int[] ids);
    void onCompleted(long requestId, in GenerationStats stats);
    /** `code` is an ErrorCode. */
    void onError(long requestId, int code, @utf8InCpp String message);
}
