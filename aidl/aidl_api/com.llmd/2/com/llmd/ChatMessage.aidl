package com.llmd;

/** One turn of a conversation. role: "system", "user" or "assistant". */
@RustDerive(Clone=true, PartialEq=true)
parcelable ChatMessage {
    @utf8InCpp String role;
    @utf8InCpp String content;
}
