package com.llmd;

/** Options for a new session. */
@RustDerive(Clone=true, PartialEq=true)
parcelable SessionOptions {
    /** Most tokens the session's context may hold (0 = the model's context length). */
    int contextTokens = 0;
}
