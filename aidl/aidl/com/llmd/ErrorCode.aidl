package com.llmd;

/** Every way a call into llmd can fail. Sent as a service-specific error code. */
@Backing(type="int")
enum ErrorCode {
    /** Not an error; never sent. */
    OK = 0,
    /** An argument is malformed: empty prompt, invalid sampling parameter, bad UTF-8. */
    INVALID_ARGUMENT = 1,
    /** No model with that id is installed. */
    MODEL_NOT_FOUND = 2,
    /** The caller lacks the permission this method needs. */
    PERMISSION_DENIED = 3,
    /** A per-caller limit is reached (sessions, queued requests). */
    QUOTA_EXCEEDED = 4,
    /** The prompt or max tokens exceed what the daemon allows or the context holds. */
    REQUEST_TOO_LARGE = 5,
    /** The daemon is at capacity; retry later. */
    BUSY = 6,
    /** The request was cancelled by its caller. */
    CANCELLED = 7,
    /** The session was closed, or belongs to someone else. */
    SESSION_CLOSED = 8,
    /** The model could not be loaded (corrupt or unsupported file). */
    MODEL_LOAD_FAILED = 9,
    /** Anything else; the message says what. */
    INTERNAL = 10,
    /** The request's deadline passed before it finished (since version 2). */
    DEADLINE_EXCEEDED = 11,
}
