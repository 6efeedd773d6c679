// Host stand-in for android.os.RemoteException (JVM tests only).
package android.os;

public class RemoteException extends Exception {
    public RemoteException() {}
    public RemoteException(String message) { super(message); }
    public RuntimeException rethrowFromSystemServer() { return new RuntimeException(this); }
}
