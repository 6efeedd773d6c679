package com.llmd.client

import android.os.DeadObjectException
import android.os.RemoteException
import android.os.ServiceSpecificException

/**
 * Every way a call to llmd fails, one class per `com.llmd.ErrorCode` (plus [ServiceUnavailable]
 * when the daemon cannot be reached). [code] is the wire code, or -1.
 */
sealed class LlmException(message: String, val code: Int, cause: Throwable? = null) : Exception(message, cause) {
    class InvalidArgument(message: String) : LlmException(message, 1)
    class ModelNotFound(message: String) : LlmException(message, 2)
    class PermissionDenied(message: String) : LlmException(message, 3)
    class QuotaExceeded(message: String) : LlmException(message, 4)
    class RequestTooLarge(message: String) : LlmException(message, 5)
    class Busy(message: String) : LlmException(message, 6)
    class Cancelled(message: String) : LlmException(message, 7)
    class SessionClosed(message: String) : LlmException(message, 8)
    class ModelLoadFailed(message: String) : LlmException(message, 9)
    class Internal(message: String) : LlmException(message, 10)
    /** The request's deadline (`GenerateRequest.deadlineMs`) passed before it finished. */
    class DeadlineExceeded(message: String) : LlmException(message, 11)
    /** The daemon is not running, died, or could not be reached after the retries. */
    class ServiceUnavailable(message: String, cause: Throwable? = null) : LlmException(message, -1, cause)

    companion object {
        /** The exception for an `ErrorCode` value and the daemon's message. */
        fun fromCode(code: Int, message: String?): LlmException {
            val m = message ?: "llmd error $code"
            return when (code) {
                1 -> InvalidArgument(m)
                2 -> ModelNotFound(m)
                3 -> PermissionDenied(m)
                4 -> QuotaExceeded(m)
                5 -> RequestTooLarge(m)
                6 -> Busy(m)
                7 -> Cancelled(m)
                8 -> SessionClosed(m)
                9 -> ModelLoadFailed(m)
                11 -> DeadlineExceeded(m)
                else -> Internal(m)
            }
        }

        /** Maps what a Binder call threw. */
        fun from(t: Throwable): LlmException = when (t) {
            is LlmException -> t
            is ServiceSpecificException -> fromCode(t.errorCode, t.message)
            is DeadObjectException -> ServiceUnavailable("llmd died", t)
            is RemoteException -> ServiceUnavailable("llmd unreachable: ${t.message}", t)
            is IllegalArgumentException -> InvalidArgument(t.message ?: "invalid argument")
            else -> Internal(t.toString())
        }
    }
}
